"""The base of the memory-sharded strategies (FSDP, DeepSpeed, ZeRO, FairScale, pipeline, tensor parallel): each
trains with an optimizer it builds over the parameters it shards, partitions or wraps. The hand-over is written
here once: the built optimizer takes the user's optimizer state (a resumed or second fit's) and LR scheduler when
the fit starts, and at its end the user's net and optimizer get the trained weights and state back.

A subclass builds its optimizer in `setup`, sets its fit state (a `ShardedFit`, which holds that optimizer and the
scheduler) and passes the user's optimizer to `take_over_optimizer`; it says how the trained weights reach the user's
net (`hand_back_weights`, nothing where the user's net trained in place) and, where its `optimizer_state` may be
sharded, how the full state is gathered (`full_optimizer_state`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from easyfit.distributed.strategies.base import FitState
from easyfit.distributed.strategy_parts.sharding import move_scheduler


@dataclass
class ShardedFit(FitState):
    """A sharded fit: the optimizer it trains with (built by `setup`) and the user's LR scheduler, which steps that
    optimizer until the fit ends. A backend's fit state extends it."""

    optimizer: Any
    scheduler: Any


class ShardedTraining:
    """Mixed into a Strategy: the hand-over of the optimizer, scheduler and weights around a sharded fit."""

    #: put the full trained weights and optimizer state into the user's net and optimizer at the end of fit (a
    #: subclass may let the user turn it off for nets too big to gather on one rank)
    gather_at_end = True

    def take_over_optimizer(self, user_optimizer: torch.optim.Optimizer):
        """The fit's optimizer (`fit_state.optimizer`) continues from the user's optimizer state (a resumed or second
        fit's), and the fit's LR scheduler steps it; returns that optimizer."""
        fit = self.fit_state
        if user_optimizer.state:
            self.load_optimizer_state(fit.optimizer, user_optimizer.state_dict())
        move_scheduler(fit.scheduler, fit.optimizer)
        return fit.optimizer

    def trains(self, optimizer) -> bool:
        """Whether `optimizer` is the one the running fit built, whose state is read and set the backend's way."""
        return self.fit_state is not None and optimizer is self.fit_state.optimizer

    def hand_back(self, user_net: torch.nn.Module, user_optimizer: torch.optim.Optimizer, net, optimizer) -> None:
        """The scheduler back on the user's optimizer; with `gather_at_end`, the full trained state into the user's
        optimizer and the trained weights into the user's net (every rank)."""
        move_scheduler(self.fit_state.scheduler, user_optimizer)
        if self.gather_at_end:
            full_optimizer = self.full_optimizer_state(optimizer)
            self.hand_back_weights(user_net, user_optimizer, net)
            user_optimizer.load_state_dict(full_optimizer)
        super().hand_back(user_net, user_optimizer, net, optimizer)

    def hand_back_weights(self, user_net: torch.nn.Module, user_optimizer: torch.optim.Optimizer, net) -> None:
        """Put the trained weights of `net` into `user_net`: nothing to do where the user's net trained in place."""

    def full_optimizer_state(self, optimizer) -> dict:
        """The trained optimizer state in the plain optimizer's format, whole, on every rank."""
        return self.optimizer_state(optimizer)
