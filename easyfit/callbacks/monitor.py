"""A monitored log value and the rule for "better": shared by EarlyStopping and ModelCheckpoint."""
from __future__ import annotations

import math
import warnings
from collections.abc import Mapping

from easyfit.callbacks.base import Callback

MAXIMIZED = ("acc", "auc", "auroc", "f1", "precision", "recall", "r2")


class Monitor:
    """Reads `name` from epoch logs and says whether a value improves on another by more than `min_delta`.

    mode "auto" maximizes names containing acc, auc, auroc, f1, precision, recall or r2, and minimizes the rest."""

    def __init__(self, name: str, mode: str = "auto", min_delta: float = 0.0, owner: str = "callback"):
        if mode not in ("auto", "min", "max"):
            raise ValueError(f"{owner}: mode must be 'auto', 'min' or 'max', got {mode!r}")
        self.name, self.owner, self.min_delta = name, owner, abs(min_delta)
        if mode == "auto":
            mode = "max" if any(part in name.lower() for part in MAXIMIZED) else "min"
        self.mode = mode

    @property
    def worst(self) -> float:
        """The starting 'best': anything finite improves on it."""
        return math.inf if self.mode == "min" else -math.inf

    def improves(self, value: float, reference: float) -> bool:
        if self.mode == "min":
            return value + self.min_delta < reference
        return value - self.min_delta > reference

    def read(self, logs: Mapping | None, no_validation: bool = False) -> float | None:
        """The monitored value, or None when the logs lack it: with a warning listing the keys there are, unless
        it is a val_* key and `no_validation` says this epoch ran none (see `skips_validation`)."""
        logs = logs or {}
        if self.name not in logs and self.name.startswith("val_") and no_validation:
            return None
        if self.name not in logs:
            warnings.warn(f"{self.owner}: the monitored value {self.name!r} is not in the logs; available: "
                          f"{', '.join(logs) or 'none'}. Pass one of these as monitor= (val_* keys need "
                          "validation_data or validation_split).", RuntimeWarning, stacklevel=2)
            return None
        return float(logs[self.name])


def skips_validation(params: Mapping, epoch: int) -> bool:
    """Whether fit ran no validation after `epoch` because of its `validation_freq`."""
    return (epoch + 1) % params.get("validation_freq", 1) != 0


class WatchingCallback(Callback):
    """A callback whose watch (best value, waiting, ...) starts over with each fresh fit and carries on in a
    resumed one. Subclasses set their state in `_reset` and return it from `state_dict`."""

    resumed = False

    def _reset(self) -> None:
        raise NotImplementedError

    def load_state_dict(self, state: dict) -> None:
        self.__dict__.update(state)
        self.resumed = True

    def on_train_begin(self, logs=None):
        if not self.resumed:   # a fresh fit starts over; a resumed one keeps the state it was saved with
            self._reset()
        self.resumed = False
