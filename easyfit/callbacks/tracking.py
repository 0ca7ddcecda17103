"""What the experiment-tracking loggers (MLflowLogger, WandbLogger) share: what they log and when, on global rank 0
only, and how a resumed fit continues the same tracking run.

A run logs the fit's settings once (`fit_settings`), every History value per epoch (with the epoch number as step
and as the `epoch` value), `batch_loss` every `log_every_n_steps` training batches when asked, the checkpoints
ModelCheckpoint writes when asked, and the summary line. The run's id and how many epochs it holds go into every
checkpoint (this callback's state, plain strings and numbers), so a fit resumed from one (`resume_from`, or the
restart after a lost rank) continues that run: epochs the run already holds are not logged again, and epochs the
checkpoint's History holds that the run lacks are logged from it.
"""
from __future__ import annotations

import numbers

from easyfit.callbacks.base import Callback
from easyfit.utils.checks import check_positive_int


class TrackingLogger(Callback):
    """The shared part; a subclass talks to its library through the `_open` ... `_close` methods."""

    may_stop_training = False
    #: the step value of per-step logs, beside the epoch's
    STEP_KEY = "batch_step"

    def __init__(self, log_every_n_steps: int | None, log_checkpoints: bool):
        if log_every_n_steps is not None:
            check_positive_int(log_every_n_steps, f"{type(self).__name__}: log_every_n_steps",
                               "None (epochs only) or a positive number of training batches")
        self.log_every_n_steps, self.log_checkpoints = log_every_n_steps, bool(log_checkpoints)
        self.run_id: str | None = None
        self.logged_epochs = 0   # the run holds epochs 0 .. logged_epochs - 1
        self.steps = 0           # training batches seen by the run (per-step logging)
        self.logged_steps = 0    # the run holds batch_loss up to this step
        self.saved: dict | None = None   # a loaded state, until the fit it resumes starts
        self.running = False

    # --- the library (subclasses) -----------------------------------------------------
    def _open(self, run_id: str | None) -> str:
        """Start a new run (None) or continue `run_id`; return the run's id."""
        raise NotImplementedError

    def _log_params(self, params: dict) -> None:
        raise NotImplementedError

    def _log_metrics(self, values: dict, step: int, step_key: str) -> None:
        """Log `values` at `step`, which counts epochs (step_key "epoch") or training batches (STEP_KEY)."""
        raise NotImplementedError

    def _set_tag(self, key: str, value: str) -> None:
        raise NotImplementedError

    def _log_checkpoint(self, path: str) -> None:
        raise NotImplementedError

    def _close(self) -> None:
        raise NotImplementedError

    def _held_by_run(self) -> tuple[int, int]:
        """(epochs, training batches) the run holds as its store says: what an attempt that failed after logging,
        before its checkpoint, left there; (0, 0) where the store cannot be asked."""
        return 0, 0

    # --- the fit -------------------------------------------------------------------------
    def set_params(self, params: dict) -> None:
        super().set_params(params)
        if "epochs" in params:   # a new fit: a new run unless a resumed state is loaded next
            self.saved = None

    def load_state_dict(self, state: dict) -> None:
        self.saved = state

    def state_dict(self) -> dict:
        if self.run_id is None or not self.model.is_global_zero:
            return {}
        return {"run_id": self.run_id, "logged_epochs": self.logged_epochs, "steps": self.steps}

    def on_train_begin(self, logs=None):
        saved, self.saved = self.saved or {}, None
        if not self.model.is_global_zero:
            return
        if self.running:   # an attempt that failed left its run open: a restart continues it
            self._close()
        self.run_id = self._open(saved.get("run_id"))
        self.running = True
        self.logged_epochs, self.steps = saved.get("logged_epochs", 0), saved.get("steps", 0)
        self.logged_steps = self.steps
        if "run_id" in saved:   # the store knows best what a run interrupted after logging holds
            epochs, steps = self._held_by_run()
            self.logged_epochs, self.logged_steps = max(self.logged_epochs, epochs), max(self.steps, steps)
        else:
            self._log_params(fit_settings(self.model, self.params))
        self._set_tag("summary", self.params.get("summary", ""))
        for epoch, values in epoch_rows(self.model.history, self.params.get("validation_freq", 1)):
            self._log_epoch(epoch, values)   # a resumed checkpoint's epochs the run lacks

    def _log_epoch(self, epoch: int, logs) -> None:
        if epoch < self.logged_epochs:
            return
        values = {key: float(value) for key, value in (logs or {}).items() if _is_number(value)}
        self._log_metrics({"epoch": epoch, **values}, epoch, "epoch")
        self.logged_epochs = epoch + 1

    def on_epoch_end(self, epoch, logs=None):
        if self.running:
            self._log_epoch(epoch, logs)

    def on_train_batch_end(self, batch, logs=None):
        if self.running and self.log_every_n_steps is not None:
            self.steps += 1
            if self.steps % self.log_every_n_steps == 0 and self.steps > self.logged_steps:
                self._log_metrics({"batch_loss": logs["batch_loss"]}, self.steps, self.STEP_KEY)

    def on_checkpoint_saved(self, path):
        if self.running and self.log_checkpoints:
            self._log_checkpoint(path)

    def on_train_end(self, logs=None):
        if self.running:
            self.running = False
            self._close()


def fit_settings(model, params: dict) -> dict:
    """The call's settings as a run's parameters."""
    optimizer, multiplier = model.optimizer, params.get("lr_multiplier", 1.0)
    lrs = [group["lr"] for group in optimizer.param_groups] if optimizer is not None else []
    loss = model.spec.get("loss") or getattr(model.loss_fn, "__name__", type(model.loss_fn).__name__)
    return {
        "epochs": params.get("epochs"), "batch_size": params.get("batch_size"),
        "effective_batch_size": params.get("effective_batch_size"), "strategy": params.get("strategy"),
        "world_size": params.get("world_size"), "precision": params.get("precision"),
        "gradient_accumulation_steps": params.get("gradient_accumulation_steps", 1),
        "lr": _one_or_list(lrs), "scaled_lr": _one_or_list([lr * multiplier for lr in lrs]),
        "lr_scaling": params.get("lr_scaling"),
        "optimizer": model.spec.get("optimizer") or type(optimizer).__name__, "loss": loss,
        "parameters": model.count_params(),
    }


def epoch_rows(history, validation_freq: int) -> list[tuple[int, dict]]:
    """(epoch, its logs) for each epoch a History holds; a value logged only every `validation_freq` epochs (val_*)
    goes to the epochs that validated."""
    epochs, rows = list(history.epoch), {}
    validated = [epoch for epoch in epochs if (epoch + 1) % validation_freq == 0]
    for key, values in history.history.items():
        owners = epochs if len(values) == len(epochs) else validated if len(values) == len(validated) else []
        for epoch, value in zip(owners, values):
            rows.setdefault(epoch, {})[key] = value
    return [(epoch, rows.get(epoch, {})) for epoch in epochs]


def _one_or_list(values: list):
    return values[0] if len(set(values)) == 1 else values


def _is_number(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)
