"""ReduceLROnPlateau: lower the learning rate when a monitored value has stopped improving."""
from __future__ import annotations

from easyfit.callbacks.monitor import Monitor, WatchingCallback, skips_validation


class ReduceLROnPlateau(WatchingCallback):
    """Multiply every param group's learning rate by `factor` once `monitor` has not improved by more than
    `min_delta` for `patience` epochs, never going below `min_lr`.

    Args:
        monitor: an epoch log key ("val_loss", "val_accuracy", "loss", ...). Epochs without validation (with
            `validation_freq` > 1) are skipped for a val_* key: they count neither as waiting nor as improving.
        factor: the multiplier, in (0, 1).
        patience: epochs without improvement before a reduction.
        mode: "min", "max", or "auto" (max for accuracy-like names, min otherwise).
        min_delta: the smallest change that counts as an improvement.
        cooldown: epochs to wait after a reduction before counting again.
        min_lr: the lowest learning rate (in your scale, before `lr_scaling`).
        verbose: 1 prints each reduction.

    It changes the optimizer that trains (`model.optimizer` during fit, as the strategy set it up). The learning
    rates it compares with `min_lr`, prints and logs are in your scale, before fit's `lr_scaling`. The epoch logs
    get "learning_rate" (as in Keras 3): the first group's LR that epoch trained with.
    """

    def __init__(self, monitor: str = "val_loss", factor: float = 0.1, patience: int = 10, verbose: int = 0,
                 mode: str = "auto", min_delta: float = 1e-4, cooldown: int = 0, min_lr: float = 0.0):
        if not 0.0 < factor < 1.0:
            raise ValueError(f"ReduceLROnPlateau: factor must be between 0 and 1 (the LR is multiplied by it), "
                             f"got {factor!r}")
        self.monitor = Monitor(monitor, mode, min_delta, owner="ReduceLROnPlateau")
        self.factor, self.patience, self.verbose = factor, patience, verbose
        self.cooldown, self.min_lr = cooldown, min_lr
        self._reset()

    def _reset(self) -> None:
        self.best = self.monitor.worst
        self.wait = 0
        self.cooldown_counter = 0

    def state_dict(self) -> dict:
        return {"best": self.best, "wait": self.wait, "cooldown_counter": self.cooldown_counter}

    def on_epoch_begin(self, epoch, logs=None):
        if logs is not None and "learning_rate" not in logs:   # a LearningRateScheduler before it logged it already
            logs["learning_rate"] = self.model.optimizer.param_groups[0]["lr"]

    def on_epoch_end(self, epoch, logs=None):
        current = self.monitor.read(logs, skips_validation(self.params, epoch))
        if current is None:
            return
        if self.cooldown_counter > 0:
            self.cooldown_counter -= 1
            self.wait = 0
        if self.monitor.improves(current, self.best):
            self.best, self.wait = current, 0
        elif self.cooldown_counter == 0:
            self.wait += 1
            if self.wait >= self.patience and self._reduce(epoch):
                self.cooldown_counter, self.wait = self.cooldown, 0

    def _reduce(self, epoch: int) -> bool:
        """Lower each group's LR that is above `min_lr`; whether any was lowered."""
        new_lrs = []
        for group in self.model.optimizer.param_groups:
            old_lr = group["lr"]
            if old_lr > self.min_lr:
                new_lr = max(old_lr * self.factor, self.min_lr)
                group["lr"] = new_lr
                new_lrs.append(new_lr)
        if new_lrs and self.verbose and self.model.is_global_zero:
            print(f"Epoch {epoch + 1}: ReduceLROnPlateau reduces the learning rate to "
                  f"{', '.join(f'{lr:.6g}' for lr in new_lrs)}", flush=True)
        return bool(new_lrs)
