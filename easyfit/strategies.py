"""The strategy classes, for `fit(strategy=...)` with options: `easyfit.strategies.DDP(find_unused_parameters=True)`.

Each class is imported on first use, so naming a backend here never imports its optional package. `Fit` is the
object a strategy's `setup` returns (a strategy of your own subclasses it for what its fits hold), `Capabilities`
the one declaration of its flags (docs/strategies.md, "Writing your own").
"""
from __future__ import annotations

from easyfit.distributed.strategies.capabilities import Capabilities
from easyfit.distributed.strategies.registry import classes, register
from easyfit.distributed.strategies.states import Fit

__all__ = [*classes(), "Capabilities", "Fit", "register"]


def __getattr__(name: str):
    if name == "FitState":
        raise ImportError("easyfit.strategies.FitState is now easyfit.strategies.Fit: a strategy's setup returns the "
                          "fit's object (a Fit, or your subclass of it) instead of keeping `self.fit_state`, and the "
                          "step and state methods take that fit first; see docs/strategies.md")
    registered = classes()
    if name not in registered:
        raise AttributeError(f"module 'easyfit.strategies' has no attribute {name!r}; "
                             f"available: {', '.join(registered)}")
    return registered[name].load()


def __dir__() -> list[str]:
    return [*classes(), "Capabilities", "Fit", "register"]
