"""ModelCheckpoint: save full checkpoints during training, every epoch, every N batches, or on improvement."""
from __future__ import annotations

import os
import re
import string

from easyfit.callbacks.base import Callback
from easyfit.callbacks.logs import Logs
from easyfit.callbacks.monitor import Monitor, skips_validation
from easyfit.callbacks.save_frequency import SaveFrequency


class ModelCheckpoint(Callback):
    """Write a checkpoint with `model.save` (atomic: a temp file, then a rename), loadable by `Model.load`
    and resumable with `fit(resume_from=...)`; or with `save_weights_only`, the net's state dict alone
    (`model.save_weights`), which `net.load_state_dict(torch.load(path))` reads.

    Args:
        filepath: where to write; may hold format fields filled from the logs, e.g. "ckpt-{epoch:02d}-{val_loss:.3f}.pt"
            (`epoch` and `batch` count from 1).
        monitor: the log key compared when `save_best_only`.
        save_best_only: write only when `monitor` improves on the best value so far.
        mode: "min", "max", or "auto" (max for accuracy-like names, min otherwise).
        save_freq: "epoch", or an integer N: save every N training batches, counted across epochs from the last
            save; a save due inside a gradient_accumulation_steps window waits for the window's end.
        verbose: 1 prints each save (and each skipped one with `save_best_only`).
        save_weights_only: write the net's state dict instead of a full checkpoint.
        initial_value_threshold: with `save_best_only`, the value to beat before the first save.

    It runs after the other callbacks, so that a checkpoint holds their state for the epoch that just ended.
    """

    may_stop_training = False

    runs_last = True

    def __init__(self, filepath: str | os.PathLike, monitor: str = "val_loss", save_best_only: bool = False,
                 mode: str = "auto", save_freq: str | int = "epoch", verbose: int = 0,
                 save_weights_only: bool = False, initial_value_threshold: float | None = None):
        self.frequency = SaveFrequency(save_freq, "ModelCheckpoint")
        self.filepath = os.fspath(filepath)
        self.monitor = Monitor(monitor, mode, owner="ModelCheckpoint")
        self.save_best_only, self.save_freq, self.verbose = save_best_only, save_freq, verbose
        self.save_weights_only = save_weights_only
        self.best = self.monitor.worst if initial_value_threshold is None else float(initial_value_threshold)
        self.epoch = 0

    def state_dict(self) -> dict:
        return {"best": self.best, "batches_since_save": self.frequency.since_save}

    def load_state_dict(self, state: dict) -> None:
        self.best, self.frequency.since_save = state["best"], state["batches_since_save"]

    def state_key(self) -> str:
        return f"ModelCheckpoint(filepath={self.filepath!r}, monitor={self.monitor.name!r})"

    def on_train_begin(self, logs=None):
        fields = {re.split(r"[.\[]", name)[0] for _, name, _, _ in string.Formatter().parse(self.filepath) if name}
        validation_only = sorted(field for field in fields if field.startswith("val_"))
        if validation_only and not self.params.get("validation", True):
            raise ValueError(f"ModelCheckpoint's filepath {self.filepath!r} uses {', '.join(validation_only)}, which "
                             "only validation provides, but this fit has no validation data. Pass validation_data= "
                             "or validation_split= to fit, or use training values in the name, e.g. {epoch:02d} "
                             "or {loss:.3f}.")

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch
        self.frequency.epoch_begin(self.model)

    @property
    def needs_every_batch(self) -> bool:
        return self.save_freq != "epoch"

    def on_train_batch_end(self, batch, logs=None):
        if self.frequency.due(self.model, batch):
            self._save(self.epoch, batch, logs)

    def on_epoch_end(self, epoch, logs=None):
        if self.save_freq == "epoch":
            self._save(epoch, None, logs)

    def _save(self, epoch: int, batch: int | None, logs) -> None:
        # every rank must call model.save with the same path: all follow rank 0's decision
        path, value = self.model.strategy.broadcast(self._decide(epoch, batch, logs))
        if path is None:
            return
        if value is not None:
            self.best = value
        if self.save_weights_only:
            self.model.save_weights(path)
        else:
            self.model.save(path)
        self.model._callbacks.call("on_checkpoint_saved", path)   # e.g. a tracking logger uploads it

    def _decide(self, epoch: int, batch: int | None, logs) -> tuple[str | None, float | None]:
        """(path to write or None, new best value or None)."""
        if not self.save_best_only:
            path = self._format(epoch, batch, logs)
            self._say(f"Epoch {epoch + 1}: saving the model to {path}")
            return path, None
        current = self.monitor.read(logs, batch is None and skips_validation(self.params, epoch))
        if current is None:
            return None, None
        name = self.monitor.name
        if not self.monitor.improves(current, self.best):
            self._say(f"Epoch {epoch + 1}: {name} did not improve from {self.best:.5f}")
            return None, None
        path = self._format(epoch, batch, logs)
        self._say(f"Epoch {epoch + 1}: {name} improved from {self.best:.5f} to {current:.5f}, "
                  f"saving the model to {path}")
        return path, current

    def _format(self, epoch: int, batch: int | None, logs) -> str:
        fields = Logs({**(logs or {}), "epoch": epoch + 1})   # "{lr}" reads the learning rate, with a warning
        if batch is not None:
            fields["batch"] = batch + 1
        try:
            return self.filepath.format_map(fields)
        except (KeyError, IndexError, ValueError) as error:
            raise ValueError(f"ModelCheckpoint cannot fill in the filepath {self.filepath!r} ({error!r}); "
                             f"it may use these fields: {', '.join(fields)}") from None

    def _say(self, message: str) -> None:
        if self.verbose and self.model.is_global_zero:
            print(message, flush=True)
