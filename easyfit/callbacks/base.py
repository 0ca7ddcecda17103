"""The callback interface (Keras' hook names) and the list that dispatches to callbacks."""
from __future__ import annotations

import contextlib
import re
import warnings
from typing import Any

import torch

HOOKS = (
    "on_train_begin", "on_train_end", "on_epoch_begin", "on_epoch_end",
    "on_train_batch_begin", "on_train_batch_end",
    "on_test_begin", "on_test_end", "on_test_batch_begin", "on_test_batch_end",
    "on_predict_begin", "on_predict_end", "on_predict_batch_begin", "on_predict_batch_end",
    "on_checkpoint_saved", "on_exception",
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
    #: run this callback's hooks before all the others' (ThroughputMonitor: the values it adds to an epoch's logs
    #: then reach the History, the display and the loggers)
    runs_first: bool = False
    #: whether a batch hook may set `model.stop_training`: then, on several processes, the ranks agree after each
    #: step whether to stop (one tiny collective per step); a callback that never stops training says False
    may_stop_training: bool = True
    #: its batch hooks must run after every optimizer step (EMA averages each one): a fit that runs several steps
    #: per compiled call (`steps_per_execution` > 1) is refused rather than averaged every N-th step
    needs_every_step: bool = False

    @property
    def needs_every_batch(self) -> bool:
        """Whether its training batch hooks must see every batch, so fit(compile=..., steps_per_execution="auto")
        runs one step per compiled call (with several, the hooks see every N-th batch, as in Keras)."""
        return any(_overrides(self, hook) for hook in ("on_train_batch_begin", "on_train_batch_end"))

    def set_model(self, model) -> None:
        self.model = model

    def set_params(self, params: dict) -> None:
        self.params = params

    def state_dict(self) -> dict:
        """What a checkpoint stores for this callback (to resume exactly)."""
        return {}

    def state_key(self) -> str:
        """The name this callback's state is saved under, to find it again when resuming whatever the order of the
        callbacks or the display: its kind, plus what it monitors or writes where that tells two apart."""
        return type(self).__name__

    def load_state_dict(self, state: dict) -> None:
        pass

    def on_train_begin(self, logs=None): pass
    def on_train_end(self, logs=None): pass
    def on_epoch_begin(self, epoch, logs=None): pass
    def on_epoch_end(self, epoch, logs=None): pass
    def on_train_batch_begin(self, batch, logs=None): self.on_batch_begin(batch, logs)
    def on_train_batch_end(self, batch, logs=None): self.on_batch_end(batch, logs)
    def on_batch_begin(self, batch, logs=None): """Alias of on_train_batch_begin."""
    def on_batch_end(self, batch, logs=None): """Alias of on_train_batch_end."""
    def on_test_begin(self, logs=None): pass
    def on_test_end(self, logs=None): pass
    def on_test_batch_begin(self, batch, logs=None): pass
    def on_test_batch_end(self, batch, logs=None): pass
    def on_predict_begin(self, logs=None): pass
    def on_predict_end(self, logs=None): pass
    def on_predict_batch_begin(self, batch, logs=None): pass
    def on_predict_batch_end(self, batch, logs=None): pass

    def on_checkpoint_saved(self, path):
        """ModelCheckpoint wrote a checkpoint (a file, or a sharded checkpoint's folder) to `path`, on every rank."""

    def on_exception(self, exception):
        """fit, evaluate or predict raised `exception` (KeyboardInterrupt included) in this process, after its
        callbacks were set up; the exception reaches the caller after every callback's hook ran."""

    def on_fit_returned(self):
        """In the process that called fit, once fit has returned: after a spawned rank 0's state and attributes came
        back, outside every launcher and restart. A callback raises an outcome to the caller here (OptunaPruning)."""


class CallbackList:
    """Calls each hook on the callbacks that override it, in order; a hook nobody overrides costs one check."""

    def __init__(self, callbacks, model, params: dict):
        self.callbacks = sorted(callbacks, key=lambda callback: getattr(callback, "runs_last", False)
                                - getattr(callback, "runs_first", False))
        for callback in self.callbacks:
            callback.set_model(model)
            callback.set_params(params)
        self.listeners = {hook: [getattr(c, hook) for c in self.callbacks if _overrides(c, hook)] for hook in HOOKS}

    def wants(self, hook: str) -> bool:
        return bool(self.listeners[hook])

    def may_stop_mid_epoch(self) -> bool:
        """Whether a training batch hook of some callback may ask to stop training."""
        hooks = ("on_train_batch_begin", "on_train_batch_end")
        return any(callback.may_stop_training and any(_overrides(callback, hook) for hook in hooks)
                   for callback in self.callbacks)

    def call(self, hook: str, *args) -> None:
        for listener in self.listeners[hook]:
            listener(*args)

    def state_dict(self) -> dict:
        """{state key: state} of every callback with a state (two alike are told apart by a count: "#2")."""
        states: dict[str, dict] = {}
        for callback in self.callbacks:
            state = callback.state_dict()
            if state:
                states[_unique(callback.state_key(), states)] = state
        return states

    def load_state_dict(self, states: dict) -> None:
        """Give each callback the state saved under its key; warn about saved states no callback takes."""
        unclaimed, keys = _by_current_keys(states, self.callbacks), {}
        for callback in self.callbacks:
            key = _unique(callback.state_key(), keys)
            keys[key] = callback
            if key in unclaimed:
                callback.load_state_dict(unclaimed.pop(key))
        if unclaimed:
            warnings.warn(f"resuming: no callback of this fit takes the saved state of {', '.join(unclaimed)}; "
                          "that state is dropped. Pass the same callbacks (same kind, monitor and filepath) to "
                          "continue them.", RuntimeWarning, stacklevel=3)


@contextlib.contextmanager
def random_state_kept(strategy):
    """Inside the block a callback may draw random numbers (run forwards with Dropout, iterate shuffled data); after
    it torch's CPU and CUDA generators and the strategy's device generator are as before: the random state a
    checkpoint holds, and the next epoch draws, is the fit's own."""
    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []
    with torch.random.fork_rng(devices, device_type="cuda"):
        device_state = strategy.device_rng_state()
        try:
            yield
        finally:
            strategy.load_device_rng_state(device_state)


@contextlib.contextmanager
def exceptions_told(callbacks: CallbackList):
    """Inside the block, an exception is told to the callbacks (`on_exception`) before it goes on."""
    try:
        yield
    except BaseException as exception:
        callbacks.call("on_exception", exception)
        raise


def fit_returned(callbacks: list) -> None:
    """Tell the user's callbacks, in their order, that fit returned in this process."""
    for callback in callbacks:
        callback.on_fit_returned()


#: hooks that also run a callback's override of an older name for them
ALIASES = {"on_train_batch_begin": "on_batch_begin", "on_train_batch_end": "on_batch_end"}


def callback_list(callbacks) -> list:
    """`callbacks=` as a list; one callback alone is accepted, as in Keras."""
    items = [] if callbacks is None else list(callbacks) if isinstance(callbacks, (list, tuple)) else [callbacks]
    for item in items:
        if isinstance(item, type):
            raise TypeError(f"callbacks holds the class {item.__name__}; pass an instance: {item.__name__}(...)")
        if not isinstance(item, Callback):
            raise TypeError(f"callbacks must be easyfit.callbacks.Callback instances; got {type(item).__name__}")
    return items


def _overrides(callback: Callback, hook: str) -> bool:
    """Whether the callback's class (or the instance itself, e.g. LambdaCallback) defines `hook` or its alias."""
    names = (hook, ALIASES.get(hook, hook))
    return any(name in getattr(callback, "__dict__", {})
               or getattr(type(callback), name, None) is not getattr(Callback, name) for name in names)


def _unique(key: str, taken) -> str:
    """`key`, or `key#2`, `key#3`, ... when callbacks alike already took it."""
    count = 1
    while (f"{key}#{count}" if count > 1 else key) in taken:
        count += 1
    return f"{key}#{count}" if count > 1 else key


def _by_current_keys(states: dict, callbacks: list) -> dict:
    """The saved states; those of older checkpoints, keyed by position ("0:EarlyStopping"), under the key of the
    one callback of that kind, when there is exactly one."""
    renamed = {}
    for key, state in states.items():
        old = re.fullmatch(r"\d+:(\w+)", key)
        kind = [c for c in callbacks if old and type(c).__name__ == old.group(1)]
        renamed[kind[0].state_key() if len(kind) == 1 else key] = state
    return renamed
