"""The callback interface (Keras' hook names) and the list that dispatches to callbacks."""
from __future__ import annotations

from typing import Any

HOOKS = (
    "on_train_begin", "on_train_end", "on_epoch_begin", "on_epoch_end",
    "on_train_batch_begin", "on_train_batch_end",
    "on_test_begin", "on_test_end", "on_test_batch_begin", "on_test_batch_end",
    "on_predict_begin", "on_predict_end", "on_predict_batch_begin", "on_predict_batch_end",
)


class Callback:
    """Subclass and override any hook. `self.model` is the easyfit.Model; `self.params` the fit settings.

    Hooks run in every process; guard side effects with `self.model.is_global_zero`.
    Batch `logs` compute their values only when read, so a callback that does not read them costs nothing.
    """

    model: Any = None
    params: dict = {}
    #: run this callback's hooks after all the others' (ModelCheckpoint: its checkpoints then hold their state)
    runs_last: bool = False

    def set_model(self, model) -> None:
        self.model = model

    def set_params(self, params: dict) -> None:
        self.params = params

    def state_dict(self) -> dict:
        """What a checkpoint stores for this callback (to resume exactly)."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass

    def on_train_begin(self, logs=None): pass
    def on_train_end(self, logs=None): pass
    def on_epoch_begin(self, epoch, logs=None): pass
    def on_epoch_end(self, epoch, logs=None): pass
    def on_train_batch_begin(self, batch, logs=None): pass
    def on_train_batch_end(self, batch, logs=None): pass
    def on_test_begin(self, logs=None): pass
    def on_test_end(self, logs=None): pass
    def on_test_batch_begin(self, batch, logs=None): pass
    def on_test_batch_end(self, batch, logs=None): pass
    def on_predict_begin(self, logs=None): pass
    def on_predict_end(self, logs=None): pass
    def on_predict_batch_begin(self, batch, logs=None): pass
    def on_predict_batch_end(self, batch, logs=None): pass


class CallbackList:
    """Calls each hook on the callbacks that override it, in order; a hook nobody overrides costs one check."""

    def __init__(self, callbacks, model, params: dict):
        self.callbacks = sorted(callbacks, key=lambda callback: getattr(callback, "runs_last", False))
        for callback in self.callbacks:
            callback.set_model(model)
            callback.set_params(params)
        self.listeners = {hook: [getattr(c, hook) for c in self.callbacks if _overrides(c, hook)] for hook in HOOKS}

    def wants(self, hook: str) -> bool:
        return bool(self.listeners[hook])

    def call(self, hook: str, *args) -> None:
        for listener in self.listeners[hook]:
            listener(*args)

    def state_dict(self) -> dict:
        return {_key(c, i): c.state_dict() for i, c in enumerate(self.callbacks) if c.state_dict()}

    def load_state_dict(self, states: dict) -> None:
        for i, callback in enumerate(self.callbacks):
            if _key(callback, i) in states:
                callback.load_state_dict(states[_key(callback, i)])


def _overrides(callback: Callback, hook: str) -> bool:
    return getattr(type(callback), hook, None) is not getattr(Callback, hook)


def _key(callback: Callback, index: int) -> str:
    return f"{index}:{type(callback).__name__}"
