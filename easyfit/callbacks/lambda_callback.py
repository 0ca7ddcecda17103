"""LambdaCallback: a callback made of plain functions, one per hook."""
from __future__ import annotations

from collections.abc import Callable

from easyfit.callbacks.base import ALIASES, HOOKS, Callback


class LambdaCallback(Callback):
    """Run a function at each hook named in the keyword arguments, e.g.
    `LambdaCallback(on_epoch_end=lambda epoch, logs: print(epoch, logs["loss"]))`.

    Each function takes the hook's arguments: `(epoch, logs)`, `(batch, logs)` or `(logs)`. Any hook of
    `Callback` may be given; `on_batch_begin` / `on_batch_end` mean the training-batch hooks.
    """

    def __init__(self, **hooks: Callable):
        names = {alias: hook for hook, alias in ALIASES.items()}
        for name, function in hooks.items():
            hook = names.get(name, name)
            if hook not in HOOKS:
                raise TypeError(f"LambdaCallback: unknown hook {name!r}; hooks are {', '.join(HOOKS)} "
                                "(and on_batch_begin / on_batch_end)")
            if not callable(function):
                raise TypeError(f"LambdaCallback: {name} must be a function, got {function!r}")
            setattr(self, hook, function)
