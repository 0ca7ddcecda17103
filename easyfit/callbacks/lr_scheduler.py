"""LearningRateScheduler: set the learning rate at the start of each epoch from a function."""
from __future__ import annotations

import inspect
import numbers
from typing import Callable

from easyfit.callbacks.base import Callback


class LearningRateScheduler(Callback):
    """Call `schedule(epoch, lr) -> new lr` (or `schedule(epoch) -> new lr`) at the start of each epoch (epoch
    counts from 0) and set the result.

    Each param group is scheduled from its own LR. The LRs the schedule sees and returns are in the user's scale:
    when fit scales the LR for a larger effective batch (`lr_scaling`), each optimizer step takes the new LR times
    that factor. The epoch logs get "learning_rate" (Keras 3's key): the first group's scheduled LR.
    """

    def __init__(self, schedule: Callable[[int, float], float], verbose: int = 0):
        if not callable(schedule):
            raise TypeError(f"LearningRateScheduler: schedule must be a function (epoch, lr) -> lr, got {schedule!r}")
        self.schedule, self.verbose = schedule, verbose
        self.takes_lr = _takes_two_arguments(schedule)

    def on_epoch_begin(self, epoch, logs=None):
        new_lrs = []
        for group in self.model.optimizer.param_groups:
            new_lr = self.schedule(epoch, group["lr"]) if self.takes_lr else self.schedule(epoch)
            if isinstance(new_lr, bool) or not isinstance(new_lr, numbers.Real):
                raise TypeError(f"LearningRateScheduler: schedule({epoch}, lr) must return a number, got {new_lr!r}")
            group["lr"] = float(new_lr)
            new_lrs.append(float(new_lr))
        if logs is not None:
            logs["learning_rate"] = new_lrs[0]
        if self.verbose and self.model.is_global_zero:
            print(f"Epoch {epoch + 1}: LearningRateScheduler sets the learning rate to "
                  f"{', '.join(f'{lr:.6g}' for lr in new_lrs)}", flush=True)


def _takes_two_arguments(schedule: Callable) -> bool:
    """Whether `schedule` can be called as schedule(epoch, lr) (else it is called as schedule(epoch))."""
    try:
        inspect.signature(schedule).bind(0, 0.0)
    except TypeError:
        return False
    except ValueError:   # no signature to read (some builtins): assume the two-argument form
        return True
    return True
