"""The base of the memory-sharded strategies (FSDP, DeepSpeed, ZeRO, FairScale, pipeline, tensor parallel): each
trains with an optimizer it builds over the parameters it shards, partitions or wraps. The hand-over is written
here once: the built optimizer takes the user's optimizer state (a resumed or second fit's) and LR scheduler when
the fit starts, and at its end the user's net and optimizer get the trained weights and state back.

A subclass builds its optimizer in `setup` and passes it through `take_over_optimizer`; it says how the trained
weights reach the user's net (`hand_back_weights`, nothing where the user's net trained in place) and, where its
`optimizer_state` may be sharded, how the full state is gathered (`full_optimizer_state`).
"""
from __future__ import annotations

import torch

from easyfit.distributed.strategy_parts.sharding import move_scheduler


class ShardedTraining:
    """Mixed into a Strategy: the hand-over of the optimizer, scheduler and weights around a sharded fit."""

    #: put the full trained weights and optimizer state into the user's net and optimizer at the end of fit (a
    #: subclass may let the user turn it off for nets too big to gather on one rank)
    gather_at_end = True
    _scheduler = None

    def take_over_optimizer(self, user_optimizer: torch.optim.Optimizer, built, scheduler):
        """`built` (the optimizer the fit trains with) continues from the user's optimizer state, and the LR
        scheduler steps it; returns `built`."""
        if user_optimizer.state:   # a resumed or second fit continues from the user's optimizer state
            self.load_optimizer_state(built, user_optimizer.state_dict())
        move_scheduler(scheduler, built)
        self._scheduler = scheduler
        return built

    def hand_back(self, user_net: torch.nn.Module, user_optimizer: torch.optim.Optimizer, net, optimizer) -> None:
        """The scheduler back on the user's optimizer; with `gather_at_end`, the full trained state into the user's
        optimizer and the trained weights into the user's net (every rank)."""
        move_scheduler(self._scheduler, user_optimizer)
        if not self.gather_at_end:
            return
        full_optimizer = self.full_optimizer_state(optimizer)
        self.hand_back_weights(user_net, user_optimizer, net)
        user_optimizer.load_state_dict(full_optimizer)

    def hand_back_weights(self, user_net: torch.nn.Module, user_optimizer: torch.optim.Optimizer, net) -> None:
        """Put the trained weights of `net` into `user_net`: nothing to do where the user's net trained in place."""

    def full_optimizer_state(self, optimizer) -> dict:
        """The trained optimizer state in the plain optimizer's format, whole, on every rank."""
        return self.optimizer_state(optimizer)
