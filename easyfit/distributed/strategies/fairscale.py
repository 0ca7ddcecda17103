"""FairScale sharded training: OSS shards the optimizer state and ShardedDataParallel reduces each gradient only to
the rank that owns it. (FairScale's own FullyShardedDataParallel needs CUDA streams; for parameter sharding on any
device use strategy="fsdp".)"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from easyfit.distributed.strategies.sharded import ShardedFit, ShardingStrategy
from easyfit.distributed.strategy_parts.sharding import require


@dataclass
class FairScaleFit(ShardedFit):
    """A FairScale fit: its OSS optimizer (ShardedFit's) and the ShardedDataParallel net it trains."""

    wrapped: torch.nn.Module | None


class ShardedStrategy(ShardingStrategy):
    """strategy="ddp_sharded" (script re-launch, torchrun, SLURM) / "ddp_sharded_spawn"; its wrapper builds the step,
    which fit(compile=...) does not compile."""

    def __init__(self, *, start_method: str = "popen", **options):
        super().__init__(start_method=start_method, **options)
        self.name = "ddp_sharded_spawn" if start_method == "spawn" else "ddp_sharded"

    def check_precision(self, precision: str) -> None:
        if precision == "16-mixed":
            raise ValueError(f"strategy={self.name!r} does not support precision='16-mixed' (its loss scaler must "
                             "know the sharding); use precision='bf16-mixed' or '32', or strategy='fsdp'")

    def setup(self, net: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler=None):
        oss = require("fairscale.optim.oss", "fairscale", self.name)
        sharded_ddp = require("fairscale.nn.data_parallel", "fairscale", self.name)
        net.to(self.root_device)
        sharded = self.rebuilt_optimizer(optimizer, sharding=oss.OSS)
        fit = self.fit_state = FairScaleFit(optimizer=sharded, scheduler=scheduler, wrapped=None)
        fit.wrapped = sharded_ddp.ShardedDataParallel(net, self.take_over_optimizer(optimizer))   # once it took over
        return fit.wrapped, sharded, scheduler

    def end_fit(self, user_net, user_optimizer, net, optimizer) -> None:
        self._drop_gradients()
        super().end_fit(user_net, user_optimizer, net, optimizer)

    def teardown(self) -> None:
        self._drop_gradients()
        super().teardown()

    def _drop_gradients(self) -> None:
        """The gradients left in the user's parameters zeroed: the next fit's ShardedDataParallel takes their values
        into its reduce buckets, and its first step would add them to its own."""
        if isinstance(self.fit_state, FairScaleFit) and self.fit_state.wrapped is not None:
            self.fit_state.wrapped.zero_grad(set_to_none=True)

    def zero_grad(self, optimizer: torch.optim.Optimizer) -> None:
        """ShardedDataParallel keeps gradients in reduce buckets: they are zeroed through it (the optimizer's
        zero_grad(set_to_none=True) would detach them from the buckets and train wrongly, silently)."""
        self.fit_state.wrapped.zero_grad(set_to_none=True)

    def no_sync(self, net: torch.nn.Module):
        return net.no_sync()

    def clip_gradients(self, net, optimizer, max_norm: float, precision) -> None:
        """The norm over every rank's gradient shard."""
        precision.unscale_gradients(optimizer)
        optimizer.clip_grad_norm(max_norm)

    def module_for_eval(self, net: torch.nn.Module) -> torch.nn.Module:
        fit = self.fit_state
        return (net.module if fit is not None and net is fit.wrapped else net).to(self.root_device)

    def module_state(self, net: torch.nn.Module) -> dict:
        return self.module_for_eval(net).state_dict()

    def load_module_state(self, net: torch.nn.Module, state: dict) -> None:
        self.module_for_eval(net).load_state_dict(state)

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict:
        """The full state in the plain optimizer's format, on every rank."""
        if not hasattr(optimizer, "consolidate_state_dict"):
            return optimizer.state_dict()
        return optimizer.state_dict(all_ranks=True)
