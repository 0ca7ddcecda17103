"""ZeRO stage 1 with torch alone: the net trained through DistributedDataParallel (composed: ddp.DDPWrapping) with a
ZeroRedundancyOptimizer, which keeps on each rank only its share of the optimizer state (the user's optimizer class,
hyper-parameters and param groups kept)."""
from __future__ import annotations

import torch
from torch.distributed.optim import ZeroRedundancyOptimizer

from easyfit.distributed.strategies.ddp import DDPWrapping
from easyfit.distributed.strategies.sharded import ShardedFit, ShardingStrategy
from easyfit.parts.optimizers import align_state


class ZeroFit(ShardedFit):
    """A ZeRO fit: its net is the DistributedDataParallel wrapper, its optimizer a ZeroRedundancyOptimizer."""


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

    def setup(self, net: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler=None, settings=None,
              call=None) -> ZeroFit:
        net = self.wrapping.prepare(net).to(self.root_device)
        align_state(optimizer)
        wrapped = self.wrapping.wrap(net, self.root_device)
        sharded = self.rebuilt_optimizer(optimizer, sharding=ZeroRedundancyOptimizer)
        fit = ZeroFit(strategy=self, net=wrapped, optimizer=sharded, scheduler=scheduler, call=call)
        return self.take_over_optimizer(fit, optimizer)

    def backward(self, fit, loss: torch.Tensor, precision) -> None:
        super().backward(fit, loss, precision)
        if isinstance(fit, ZeroFit):
            self.wrapping.check_backward(fit.net)

    def optimizer_state(self, fit) -> dict:
        """The full state in the plain optimizer's format, on every rank (gathered on rank 0, then broadcast)."""
        optimizer = fit.optimizer
        if not isinstance(optimizer, ZeroRedundancyOptimizer):
            return optimizer.state_dict()
        optimizer.consolidate_state_dict(to=0)
        return self.broadcast(optimizer.state_dict() if self.is_global_zero else None)

    def load_optimizer_state(self, fit, state: dict) -> None:
        # ZeroRedundancyOptimizer.load_state_dict clears the other ranks' entries of what it is given: give it a copy
        fit.optimizer.load_state_dict({**state, "state": dict(state["state"])})
