"""What a call and a fit hold in a process while they run, apart from the strategy object (its configuration): the
call's `CallState` and the fit's own object, `Fit`, which the strategy's `setup` returns."""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class Launched:
    """How a call's ranks came to exist, as each rank sees it (the call's plan says, and a rank it starts is handed
    it; its `CallState` keeps it): by a launcher of easyfit's (`by_easyfit`; then they share this machine's cores, and
    easyfit restarts them), and whether that launcher started processes for this call alone (`for_this_call`: their
    default process group ends with the call)."""

    by_easyfit: bool = False
    for_this_call: bool = False


#: ranks no launcher of easyfit's started (this process alone, or torchrun's, SLURM's, ...)
NOT_LAUNCHED = Launched()


@dataclass
class CallState:
    """What one call (fit, evaluate, predict) holds in this process, from the strategy's `setup_environment` to its
    `teardown`: how its ranks came to exist, and a backend subclass's own fields."""

    launched: Launched = NOT_LAUNCHED

    @property
    def threads_note(self) -> str | None:
        """How many CPU threads this rank was given, for the summary line (None: left as they were)."""
        return None


#: the fit's calls, by name: each is its strategy's method of the name beside it, given this fit first
FIT_CALLS = {
    # the step
    "training_step": "training_step", "backward": "backward", "optimizer_step": "optimizer_step",
    "zero_grad": "zero_grad", "no_sync": "no_sync", "uneven_inputs": "uneven_inputs",
    "clip_gradients": "clip_gradients",
    # evaluation
    "module_for_eval": "module_for_eval", "forward_in_lockstep": "forward_in_lockstep",
    # state (every rank)
    "module_state": "module_state", "load_module_state": "load_module_state", "optimizer_state": "optimizer_state",
    "load_optimizer_state": "load_optimizer_state", "local_tensors": "local_tensors",
    "save_checkpoint": "save_checkpoint", "load_checkpoint": "load_checkpoint",
    # the summary line, and the fit's end: well (the trained state into the user's objects) or raised
    "describe": "describe_setup", "end": "end_fit", "abandon": "abandon_fit",
}


@dataclass(kw_only=True)
class Fit:
    """One fit on one rank, from the strategy's `setup` to `end`: what trains (the net or engine, the optimizer and
    the scheduler everyone uses until the fit ends) and what the backend keeps for it (a subclass's fields: a
    wrapper's hook state, an engine, step flags), in the call `call`. The loop, the Model and the callbacks talk to
    it: its calls (`FIT_CALLS`) are the strategy's methods given this fit first, so `fit.backward(loss, precision)`
    is `strategy.backward(fit, loss, precision)`. Outside a fit, a Fit of the Model's own objects (no backend state)
    reads and loads their state the plain way."""

    strategy: Any
    net: torch.nn.Module
    optimizer: Any = None
    scheduler: Any = None
    call: CallState | None = None   # the call it runs in (what the strategy's `setup_environment` returned)

    def __post_init__(self):
        for name, method in FIT_CALLS.items():   # bound once: a step's call is the strategy's, with no hop between
            setattr(self, name, functools.partial(getattr(self.strategy, method), self))
