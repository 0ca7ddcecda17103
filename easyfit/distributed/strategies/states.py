"""What a call and a fit hold in a process while they run, apart from the strategy object (its configuration): the
call's `CallState` and the fit's own object, `Fit`, which the strategy's `setup` returns."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class CallState:
    """What one call (fit, evaluate, predict) holds in this process; a backend subclasses it."""


@dataclass(kw_only=True)
class Fit:
    """One fit on one rank, from the strategy's `setup` to `end`: what trains (the net or engine, the optimizer and
    the scheduler everyone uses until the fit ends) and what the backend keeps for it (a subclass's fields: a
    wrapper's hook state, an engine, step flags). The loop, the Model and the callbacks talk to it: its step and
    state calls run the strategy's with this fit. Outside a fit, a Fit of the Model's own objects (no backend state)
    reads and loads their state the plain way."""

    strategy: Any
    net: torch.nn.Module
    optimizer: Any = None
    scheduler: Any = None

    # --- the step -------------------------------------------------------------------
    def training_step(self, inputs: Any, target: Any, step_fn, precision, divisor: int = 1):
        return self.strategy.training_step(self, inputs, target, step_fn, precision, divisor)

    def backward(self, loss: torch.Tensor, precision) -> None:
        self.strategy.backward(self, loss, precision)

    def optimizer_step(self, precision) -> None:
        self.strategy.optimizer_step(self, precision)

    def zero_grad(self) -> None:
        self.strategy.zero_grad(self)

    def no_sync(self) -> contextlib.AbstractContextManager:
        return self.strategy.no_sync(self)

    def uneven_inputs(self) -> contextlib.AbstractContextManager:
        return self.strategy.uneven_inputs(self)

    def clip_gradients(self, max_norm: float, precision) -> None:
        self.strategy.clip_gradients(self, max_norm, precision)

    # --- evaluation -----------------------------------------------------------------
    def module_for_eval(self) -> torch.nn.Module:
        return self.strategy.module_for_eval(self)

    def forward_in_lockstep(self) -> bool:
        return self.strategy.forward_in_lockstep(self)

    # --- state (every rank) -----------------------------------------------------------
    def module_state(self) -> dict:
        return self.strategy.module_state(self)

    def load_module_state(self, state: dict) -> None:
        self.strategy.load_module_state(self, state)

    def optimizer_state(self) -> dict:
        return self.strategy.optimizer_state(self)

    def load_optimizer_state(self, state: dict) -> None:
        self.strategy.load_optimizer_state(self, state)

    def local_tensors(self, buffers: bool = False) -> list[torch.Tensor]:
        return self.strategy.local_tensors(self, buffers)

    def save_checkpoint(self, path: str, state: dict) -> None:
        self.strategy.save_checkpoint(self, path, state)

    def load_checkpoint(self, path: str) -> dict:
        return self.strategy.load_checkpoint(self, path)

    def describe(self) -> str | None:
        """Words for the summary line on what `setup` chose that the user did not set; None: nothing."""
        return self.strategy.describe_setup(self)

    def end(self, user_net: torch.nn.Module, user_optimizer) -> None:
        """The fit ended well: the trained state into the user's net and optimizer, on every rank."""
        self.strategy.end_fit(self, user_net, user_optimizer)

    def abandon(self) -> None:
        """The fit raised: the user's objects left usable."""
        self.strategy.abandon_fit(self)
