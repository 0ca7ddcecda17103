"""History: the per-epoch logs of a fit, returned by Model.fit."""
from __future__ import annotations

from easyfit.callbacks.base import Callback
from easyfit.callbacks.logs import Logs, renamed


class History(Callback):
    """`history.history["loss"]` lists the epoch losses; `history.epoch` the epoch numbers. The learning rate a
    callback logs is `history.history["learning_rate"]` (Keras 3's key; "lr" reads it, with a DeprecationWarning,
    for one release)."""

    def __init__(self):
        self.history: dict[str, list[float]] = Logs()
        self.epoch: list[int] = []
        self.params: dict = {}

    def on_epoch_end(self, epoch, logs=None):
        self.epoch.append(epoch)
        for key, value in (logs or {}).items():
            self.history.setdefault(key, []).append(value)

    def state_dict(self) -> dict:
        return {"history": dict(self.history), "epoch": self.epoch, "params": self.params}

    def load_state_dict(self, state: dict) -> None:
        self.history = renamed({key: list(values) for key, values in state["history"].items()})
        self.epoch = list(state["epoch"])
        self.params = dict(state.get("params", {}))

    def plot(self, path: str | None = None, keys: list[str] | None = None):
        """Draw loss and metric curves (train and validation together); save to `path` if given.

        Needs matplotlib: pip install easyfit[plot]."""
        from easyfit.utils.plotting import plot_history
        return plot_history(self, path, keys)

    def __repr__(self) -> str:
        last = {key: round(values[-1], 4) for key, values in self.history.items() if values}
        return f"History(epochs={len(self.epoch)}, last={last})"
