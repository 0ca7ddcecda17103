"""The strategy classes, for `fit(strategy=...)` with options: `easyfit.strategies.DDP(find_unused_parameters=True)`.

Each class is imported on first use, so naming a backend here never imports its optional package. `FitState` is the
base of what one fit of a strategy of your own holds, `Capabilities` the one declaration of its flags
(docs/strategies.md, "Writing your own").
"""
from __future__ import annotations

from easyfit.distributed.strategies.base import FitState
from easyfit.distributed.strategies.capabilities import Capabilities
from easyfit.distributed.strategies.registry import classes, register

__all__ = [*classes(), "Capabilities", "FitState", "register"]


def __getattr__(name: str):
    registered = classes()
    if name not in registered:
        raise AttributeError(f"module 'easyfit.strategies' has no attribute {name!r}; "
                             f"available: {', '.join(registered)}")
    return registered[name].load()


def __dir__() -> list[str]:
    return [*classes(), "Capabilities", "FitState", "register"]
