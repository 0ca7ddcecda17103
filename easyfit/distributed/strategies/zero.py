"""ZeRO stage 1 with torch alone: DistributedDataParallel plus a ZeroRedundancyOptimizer, which keeps on each rank
only its share of the optimizer state (the user's optimizer class, hyper-parameters and param groups kept)."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.optim import ZeroRedundancyOptimizer

from easyfit.distributed.strategies.ddp import DDPFit, DDPStrategy
from easyfit.distributed.strategies.sharded import ShardedFit, ShardedTraining


@dataclass
class ZeroFit(ShardedFit, DDPFit):
    """A ZeRO fit: DDP's (the wrapped net, the hook state) and the ZeroRedundancyOptimizer it trains with."""


class ZeroStrategy(ShardedTraining, DDPStrategy):
    """strategy="zero": full parameters and gradients on every rank, optimizer state sharded."""

    supports_compile = False   # its engine / wrapper builds the step: not compiled by fit(compile=...)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.name = "zero"

    def setup(self, net: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler=None):
        net, optimizer, scheduler = super().setup(net, optimizer, scheduler)
        sharded = self.rebuilt_optimizer(optimizer, sharding=ZeroRedundancyOptimizer)
        ddp = self.fit_state
        self.fit_state = ZeroFit(wrapped=ddp.wrapped, hook_state=ddp.hook_state, optimizer=sharded, scheduler=scheduler)
        return net, self.take_over_optimizer(optimizer), scheduler

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict:
        """The full state in the plain optimizer's format, on every rank (gathered on rank 0, then broadcast)."""
        if not isinstance(optimizer, ZeroRedundancyOptimizer):
            return optimizer.state_dict()
        optimizer.consolidate_state_dict(to=0)
        return self.broadcast(optimizer.state_dict() if self.is_global_zero else None)

    def load_optimizer_state(self, optimizer: torch.optim.Optimizer, state: dict) -> None:
        # ZeroRedundancyOptimizer.load_state_dict clears the other ranks' entries of what it is given: give it a copy
        optimizer.load_state_dict({**state, "state": dict(state["state"])})
