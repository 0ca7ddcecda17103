"""`ShardingStrategy`, the base of the memory-sharded strategies (FSDP, tensor parallel, DeepSpeed, ZeRO, FairScale,
pipeline): each trains with an optimizer it builds over the parameters it shards, partitions or wraps. What they share
with data parallelism (ranks, samplers, the process group, the launch) is their common base's, ParallelStrategy; what
they share with one another is written here once: the user's optimizer rebuilt over the new parameters
(`rebuilt_optimizer`), the hand-over (the built optimizer takes the user's optimizer state, a resumed or second fit's,
and LR scheduler when the fit starts, and at its end the user's net and optimizer get the trained weights and state
back), and for a backend whose trained state may be too big for one rank (`STATE_FORMATS` with "sharded": DTensor's,
DeepSpeed) the evaluation copy and the sharded checkpoint.

A subclass builds its optimizer in `setup` (its own sharding), makes its fit (a `ShardedFit`, which holds that
optimizer and the scheduler) and hands it the user's optimizer (`take_over_optimizer`); it says how the trained
weights reach the user's net (`hand_back_weights`, nothing where the user's net trained in place) and, where its
`optimizer_state` may be sharded, how the full state is gathered (`full_optimizer_state`).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable

import torch

from easyfit.distributed.strategies.parallel import ParallelStrategy
from easyfit.distributed.strategies.states import Fit
from easyfit.distributed.strategy_parts.sharding import (
    directory_outside_fit,
    move_scheduler,
    optimizer_params,
    param_names,
    rebuild_optimizer,
)

#: the checkpoint formats: one consolidated file, or a directory each rank writes its shards to
FULL, SHARDED = "full", "sharded"


@dataclass(kw_only=True)
class ShardedFit(Fit):
    """A sharded fit: its optimizer is the one `setup` built, which the user's LR scheduler steps until the fit
    ends. A backend's fit extends it."""


class ShardingStrategy(ParallelStrategy):
    """A strategy that trains with an optimizer it builds over the parameters it shards, and hands the trained state
    back at the end of fit. A backend whose trained state may be too big for one rank also says whether a fit
    trains a sharded net (`trains_sharded`), how a plain copy of it is made (`gathered_copy`) and how its shards are
    written and read (`save_shards`, `load_shards`), and lists "sharded" in its `STATE_FORMATS`.

    Args:
        state_dict_type: "full" (checkpoints are one consolidated file) or, where the backend writes it, "sharded" (a
            directory each rank writes its shards to; for nets too big to gather on one rank).
        hand_back: put the full trained weights and optimizer state into the user's net and optimizer at the end of
            fit (False for nets too big to gather on one rank: save a sharded checkpoint instead).
        start_method, and the placement options: ParallelStrategy's.
    """

    #: the checkpoint formats this backend writes (`state_dict_type`)
    STATE_FORMATS = (FULL,)

    def __init__(self, *, state_dict_type: str = FULL, hand_back: bool = True, start_method: str | None = "popen",
                 **placement):
        super().__init__(start_method=start_method, **placement)
        if state_dict_type not in self.STATE_FORMATS:
            raise ValueError(f"state_dict_type must be one of {', '.join(self.STATE_FORMATS)}, got "
                             f"{state_dict_type!r}")
        self.state_dict_type, self.hand_back = state_dict_type, hand_back

    @staticmethod
    def rebuilt_optimizer(optimizer: torch.optim.Optimizer, user_net: torch.nn.Module | None = None,
                          trained: torch.nn.Module | None = None, sharding: Callable | None = None):
        """The user's optimizer (its class, hyper-parameters and param groups, no state) over `trained`'s parameters,
        each matched to `user_net`'s by name (no `trained`: over the user's own parameters); with `sharding`
        (ZeroRedundancyOptimizer, FairScale's OSS), that optimizer built around the user's class."""
        if trained is None:
            return rebuild_optimizer(optimizer, lambda param: param, sharding)
        own = dict(trained.named_parameters())
        names = dict(zip(map(id, optimizer_params(optimizer)), param_names(user_net, optimizer)))
        return rebuild_optimizer(optimizer, lambda param: own[names[id(param)]], sharding)

    def take_over_optimizer(self, fit: ShardedFit, user_optimizer: torch.optim.Optimizer) -> ShardedFit:
        """`fit`'s optimizer continues from the user's optimizer state (a resumed or second fit's), and the fit's LR
        scheduler steps it; returns the fit."""
        if user_optimizer.state:
            self.load_optimizer_state(fit, user_optimizer.state_dict())
        move_scheduler(fit.scheduler, fit.optimizer)
        return fit

    def end_fit(self, fit: ShardedFit, user_net: torch.nn.Module, user_optimizer: torch.optim.Optimizer) -> None:
        """The scheduler back on the user's optimizer; with `hand_back`, the full trained state into the user's
        optimizer and the trained weights into the user's net (every rank)."""
        move_scheduler(fit.scheduler, user_optimizer)
        if self.hand_back:
            full_optimizer = self.full_optimizer_state(fit)
            self.hand_back_weights(fit, user_net, user_optimizer)
            user_optimizer.load_state_dict(full_optimizer)
        super().end_fit(fit, user_net, user_optimizer)

    def hand_back_weights(self, fit: ShardedFit, user_net: torch.nn.Module,
                          user_optimizer: torch.optim.Optimizer) -> None:
        """Put the trained weights of the fit's net into `user_net`: nothing to do where the user's net trained in
        place."""

    def full_optimizer_state(self, fit: ShardedFit) -> dict:
        """The trained optimizer state in the plain optimizer's format, whole, on every rank."""
        return self.optimizer_state(fit)

    # --- evaluation -----------------------------------------------------------------
    def trains_sharded(self, fit: Fit) -> bool:
        """Whether `fit` trains a sharded net (not the user's, nor a Model's objects outside a fit), of which
        validation runs a gathered copy (`module_for_eval`); none here."""
        return False

    def forward_in_lockstep(self, fit: Fit) -> bool:
        """With hand_back=False (a net too big to gather) nothing is ever gathered: the first-batch check and
        validation run the sharded net, every rank in step."""
        return self.trains_sharded(fit) and self.capabilities.shards_parameters and not self.hand_back

    def gathered_copy(self, fit: ShardedFit) -> torch.nn.Module:
        """The backend's: a plain copy of the user's net with the gathered weights of the fit's net, on this
        device."""
        raise NotImplementedError

    def module_for_eval(self, fit: Fit) -> torch.nn.Module:
        """Validation inside fit runs a plain copy of the user's net with the gathered weights, made for the pass:
        ranks may get different numbers of evaluation batches, and a sharded forward would wait for the others at
        every layer; it holds rank 0's buffers, so the ranks evaluate one net. With hand_back=False the sharded net
        itself runs (`forward_in_lockstep`)."""
        if not self.trains_sharded(fit):
            return super().module_for_eval(fit)
        if self.forward_in_lockstep(fit):
            return fit.net
        from easyfit.distributed.strategy_parts.buffers import share_rank_zero_buffers
        gathered = self.gathered_copy(fit)
        share_rank_zero_buffers(self, gathered)
        return gathered

    # --- checkpoints ----------------------------------------------------------------
    def save_shards(self, fit: ShardedFit, path: str, state: dict) -> None:
        """The backend's: write the fit's `state` as a sharded checkpoint directory (each rank its shards)."""
        raise NotImplementedError

    def save_checkpoint(self, fit: Fit, path: str, state: dict) -> None:
        """"full": one file written by rank 0. "sharded" (inside a fit): a directory each rank writes its shards to
        (`save_shards`)."""
        if self.state_dict_type == FULL or not isinstance(fit, ShardedFit):
            return super().save_checkpoint(fit, path, state)
        self.save_shards(fit, path, state)

    def load_shards(self, fit: ShardedFit, path: str) -> dict:
        """The backend's: the sharded directory at `path` loaded into the fit; the rest of its state."""
        raise NotImplementedError

    def sharded_folder(self) -> tuple[str, str]:
        """In words: what this backend's sharded checkpoint directory is called, and under what it resumes."""
        return "sharded", f"strategy={self.name!r}"

    def load_checkpoint(self, fit: Fit, path: str) -> dict:
        """Either format; a sharded directory inside a fit only, whose net and optimizer its shards load into."""
        if not os.path.isdir(path) or SHARDED not in self.STATE_FORMATS:
            return super().load_checkpoint(fit, path)
        if not isinstance(fit, ShardedFit):
            raise directory_outside_fit(path, *self.sharded_folder())
        return self.load_shards(fit, path)
