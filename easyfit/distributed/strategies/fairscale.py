"""FairScale sharded training: OSS shards the optimizer state and ShardedDataParallel reduces each gradient only to
the rank that owns it. (FairScale's own FullyShardedDataParallel needs CUDA streams; for parameter sharding on any
device use strategy="fsdp".)"""
from __future__ import annotations

import torch

from easyfit.distributed.strategies.sharded import ShardedFit, ShardingStrategy
from easyfit.distributed.strategy_parts.sharding import require


class FairScaleFit(ShardedFit):
    """A FairScale fit: its net is the ShardedDataParallel wrapper, its optimizer an OSS."""


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

    def setup(self, net: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler=None, settings=None,
              call=None) -> FairScaleFit:
        """The gradients a failed fit left in the user's parameters are dropped first: ShardedDataParallel takes
        their values into its reduce buckets, and its first step would add them to its own."""
        oss = require("fairscale.optim.oss", "fairscale", self.name)
        sharded_ddp = require("fairscale.nn.data_parallel", "fairscale", self.name)
        net.to(self.root_device).zero_grad(set_to_none=True)
        sharded = self.rebuilt_optimizer(optimizer, sharding=oss.OSS)
        fit = self.take_over_optimizer(FairScaleFit(strategy=self, net=net, optimizer=sharded, scheduler=scheduler,
                                                    call=call), optimizer)
        fit.net = sharded_ddp.ShardedDataParallel(net, sharded)   # once it took over the user's state
        return fit

    def end_fit(self, fit: FairScaleFit, user_net, user_optimizer) -> None:
        """The gradients left in the user's parameters are dropped (see `setup`)."""
        fit.net.zero_grad(set_to_none=True)
        super().end_fit(fit, user_net, user_optimizer)

    def zero_grad(self, fit: FairScaleFit) -> None:
        """ShardedDataParallel keeps gradients in reduce buckets: they are zeroed through it (the optimizer's
        zero_grad(set_to_none=True) would detach them from the buckets and train wrongly, silently)."""
        fit.net.zero_grad(set_to_none=True)

    def no_sync(self, fit: FairScaleFit):
        return fit.net.no_sync()

    def clip_gradients(self, fit: FairScaleFit, max_norm: float, precision) -> None:
        """The norm over every rank's gradient shard."""
        precision.unscale_gradients(fit.optimizer)
        fit.optimizer.clip_grad_norm(max_norm)

    def module_for_eval(self, fit) -> torch.nn.Module:
        net = fit.net
        return (net.module if isinstance(fit, FairScaleFit) else net).to(self.root_device)

    def module_state(self, fit) -> dict:
        return self.module_for_eval(fit).state_dict()

    def load_module_state(self, fit, state: dict) -> None:
        self.module_for_eval(fit).load_state_dict(state)

    def optimizer_state(self, fit) -> dict:
        """The full state in the plain optimizer's format, on every rank."""
        if not hasattr(fit.optimizer, "consolidate_state_dict"):
            return fit.optimizer.state_dict()
        return fit.optimizer.state_dict(all_ranks=True)
