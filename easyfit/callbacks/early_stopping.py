"""EarlyStopping: stop training when a monitored value has stopped improving."""
from __future__ import annotations

from easyfit.callbacks.monitor import Monitor, WatchingCallback, skips_validation


class EarlyStopping(WatchingCallback):
    """Stop when `monitor` has not improved by more than `min_delta` for `patience` epochs.

    Args:
        monitor: an epoch log key ("val_loss", "val_accuracy", "loss", ...).
        min_delta: the smallest change that counts as an improvement.
        patience: epochs without improvement to wait before stopping.
        mode: "min", "max", or "auto" (max for accuracy-like names, min otherwise).
        baseline: the waiting only restarts when the value also beats this. An epoch that improves on the best
            never stops training; the first one that does not stops it once `patience` epochs have passed
            since the waiting last restarted (from the start, if no value ever beat the baseline).
        restore_best_weights: at the end of training, load the net's weights from the best epoch.
        start_from_epoch: epochs to train before watching (a warm-up).
        verbose: 1 prints when it stops.
    """

    def __init__(self, monitor: str = "val_loss", min_delta: float = 0.0, patience: int = 0, mode: str = "auto",
                 baseline: float | None = None, restore_best_weights: bool = False, start_from_epoch: int = 0,
                 verbose: int = 0):
        self.monitor = Monitor(monitor, mode, min_delta, owner="EarlyStopping")
        self.patience, self.baseline, self.verbose = patience, baseline, verbose
        self.restore_best_weights, self.start_from_epoch = restore_best_weights, start_from_epoch
        self._reset()

    def _reset(self) -> None:
        self.wait = 0
        self.stopped_epoch = 0
        self.best = self.monitor.worst
        self.best_epoch = 0
        self.best_weights: dict | None = None

    def state_dict(self) -> dict:
        return {"wait": self.wait, "stopped_epoch": self.stopped_epoch, "best": self.best,
                "best_epoch": self.best_epoch, "best_weights": self.best_weights}

    def state_key(self) -> str:
        return f"EarlyStopping(monitor={self.monitor.name!r})"

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        if self.best_weights is not None:   # a checkpoint loads onto the training device; keep the copy on the CPU
            self.best_weights = _cpu_copy(self.best_weights)

    def on_epoch_end(self, epoch, logs=None):
        current = self.monitor.read(logs, skips_validation(self.params, epoch))
        if current is None or epoch < self.start_from_epoch:
            return
        if self.restore_best_weights and self.best_weights is None:
            self.best_weights = self._copy_weights()   # something to restore even if nothing ever improves
            self.best_epoch = epoch
        self.wait += 1
        if self.monitor.improves(current, self.best):
            self.best, self.best_epoch = current, epoch
            if self.restore_best_weights:
                self.best_weights = self._copy_weights()
            if self.baseline is None or self.monitor.improves(current, self.baseline):
                self.wait = 0   # waiting restarts only on a value that beats the baseline too
            return   # an improving epoch never stops training
        if self.wait >= self.patience and epoch > 0:
            self.stopped_epoch = epoch
            self.model.stop_training = True

    def on_train_end(self, logs=None):
        if self.stopped_epoch and self.verbose and self.model.is_global_zero:
            print(f"Epoch {self.stopped_epoch + 1}: early stopping ({self.monitor.name} best "
                  f"{self.best:.6g} at epoch {self.best_epoch + 1})", flush=True)
        if self.restore_best_weights and self.best_weights is not None:
            if self.verbose and self.model.is_global_zero:
                print(f"Restoring the net's weights from the end of epoch {self.best_epoch + 1}", flush=True)
            self.model.load_net_state(self.best_weights)

    def _copy_weights(self) -> dict:
        return _cpu_copy(self.model.net_state())


def _cpu_copy(state: dict) -> dict:
    return {key: value.detach().to("cpu", copy=True) for key, value in state.items()}
