"""The kinds of call a Model runs through a plan: fit, evaluate, predict and find_batch_size, each one `CallKind`
saying what every rank runs for it and what follows from its training. A call reads by name from the Model to the
rank's body: `Model.fit` -> `FIT` (easyfit.training.on_rank) -> `plan_call` -> `call_on_rank` -> `FIT.on_rank`."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable


@dataclass(frozen=True)
class CallKind:
    """One kind of call.

    Attributes:
        name: the Model method's name, for messages and run names.
        on_rank: the body every rank runs, `on_rank(model, run options, x=..., y=..., options=...)`.
        check: `check(model, options)`: the call's options checked before any process starts (raises on a bad one),
            in the form the ranks read; None: the call checks its own.
        trains: the call trains the net: the training memory helps choose the strategy, a failed call may restart,
            the epochs' summary is printed, and a rank 0 in another process hands its trained state back to the
            caller, which restores it.
    """
    name: str
    on_rank: Callable
    check: Callable[[Any, Any], Any] | None = None
    trains: bool = False

    def __repr__(self) -> str:
        return f"CallKind({self.name!r})"
