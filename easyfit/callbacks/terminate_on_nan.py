"""TerminateOnNaN: stop training at the first batch whose loss is NaN or infinite."""
from __future__ import annotations

import math
import warnings

from easyfit.callbacks.base import Callback


class TerminateOnNaN(Callback):
    """Stop training after a batch whose loss is NaN or infinite, in every process at once.

    The report (epoch, batch and training step, counted from 1) is warned on global rank 0 and kept in
    `self.message` (None while all is well). Checking reads each batch's loss: one device sync per step.
    """

    def __init__(self):
        self.message: str | None = None
        self.epoch = 0

    def on_train_begin(self, logs=None):
        self.message = None

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        loss = logs["batch_loss"]
        if not self._any_process_invalid(loss):
            return
        self.model.stop_training = True
        value = loss if not math.isfinite(loss) else "not finite in another process"
        steps_per_epoch = self.params.get("steps_per_epoch")
        step = f" (training step {self.epoch * steps_per_epoch + batch + 1})" if steps_per_epoch else ""
        self.message = (f"TerminateOnNaN: the training loss is {value} at epoch {self.epoch + 1}, batch {batch + 1}"
                        f"{step}; training stopped")
        if self.model.is_global_zero:
            warnings.warn(self.message, RuntimeWarning, stacklevel=1)

    def _any_process_invalid(self, loss: float) -> bool:
        return self.model.strategy.any_rank(not math.isfinite(loss))
