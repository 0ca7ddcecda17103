"""ZeRO stage 1 with torch alone: the net trained through DistributedDataParallel (composed: ddp.DDPWrapping) with a
ZeroRedundancyOptimizer, which keeps on each rank only its share of the optimizer state (the user's optimizer class,
hyper-parameters and param groups kept)."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel

from easyfit.distributed.strategies.ddp import DDPWrapping
from easyfit.distributed.strategies.sharded import ShardedFit, ShardingStrategy
from easyfit.parts.optimizers import align_state


@dataclass
class ZeroFit(ShardedFit):
    """A ZeRO fit: the ZeroRedundancyOptimizer it trains with (ShardedFit's) and the DistributedDataParallel net."""

    wrapped: DistributedDataParallel


class ZeroStrategy(ShardingStrategy):
    """strategy="zero": full parameters and gradients on every rank, optimizer state sharded; its wrapper builds the
    step, which fit(compile=...) does not compile.

    Args:
        find_unused_parameters, sync_batchnorm, gradient_as_bucket_view: the DistributedDataParallel wrapper's (see
            ddp.DDPWrapping).
        start_method, and the placement options: see ShardingStrategy.
    """

    name = "zero"

    def __init__(self, *, find_unused_parameters: bool = False, sync_batchnorm: bool = False,
                 gradient_as_bucket_view: bool = True, **options):
        super().__init__(**options)
        self.wrapping = DDPWrapping(find_unused_parameters, sync_batchnorm, gradient_as_bucket_view)

    def setup(self, net: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler=None):
        net = self.wrapping.prepare(net).to(self.root_device)
        align_state(optimizer)
        wrapped = self.wrapping.wrap(net, self.root_device)
        sharded = self.rebuilt_optimizer(optimizer, sharding=ZeroRedundancyOptimizer)
        self.fit_state = ZeroFit(optimizer=sharded, scheduler=scheduler, wrapped=wrapped)
        return wrapped, self.take_over_optimizer(optimizer), scheduler

    def backward(self, loss: torch.Tensor, precision) -> None:
        super().backward(loss, precision)
        if isinstance(self.fit_state, ZeroFit):
            self.wrapping.check_backward(self.fit_state.wrapped)

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict:
        """The full state in the plain optimizer's format, on every rank (gathered on rank 0, then broadcast)."""
        if not isinstance(optimizer, ZeroRedundancyOptimizer):
            return optimizer.state_dict()
        optimizer.consolidate_state_dict(to=0)
        return self.broadcast(optimizer.state_dict() if self.is_global_zero else None)

    def load_optimizer_state(self, optimizer: torch.optim.Optimizer, state: dict) -> None:
        # ZeroRedundancyOptimizer.load_state_dict clears the other ranks' entries of what it is given: give it a copy
        optimizer.load_state_dict({**state, "state": dict(state["state"])})
