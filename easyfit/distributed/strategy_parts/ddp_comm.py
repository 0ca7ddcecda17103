"""DDP communication options: compressed gradient all-reduce and periodic model averaging (local SGD).

- `comm_hook="fp16"` / `"bf16"`: gradients are sent in half precision and averaged back in full precision
  (torch's `fp16_compress_hook` / `bf16_compress_hook`). bf16 needs NCCL >= 2.10 (CUDA); torch refuses it on gloo.
- `comm_hook="powersgd"`: low-rank gradient compression with error feedback (`powerSGD_hook`); plain all-reduce
  for the first `powersgd_start_step` steps, rank `powersgd_rank` after.
- `model_averaging_period=N`: post-local SGD. Each rank steps on its own gradients (DDP's all-reduce is replaced by
  `post_localSGD_hook` over a one-rank subgroup), and every N optimizer steps the parameters are averaged over all
  ranks (`PeriodicModelAverager` inside `PostLocalSGDOptimizer`), after `model_averaging_warmup` steps of ordinary
  gradient averaging.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

COMM_HOOKS = ("fp16", "bf16", "powersgd")


@dataclass(frozen=True)
class CommOptions:
    """What DDPStrategy was asked for; `validate` raises on bad values before any training work."""

    comm_hook: str | None = None
    powersgd_rank: int = 1
    powersgd_start_step: int = 10
    model_averaging_period: int | None = None
    model_averaging_warmup: int = 0

    def __post_init__(self) -> None:
        if self.comm_hook is not None and self.comm_hook not in COMM_HOOKS:
            raise ValueError(f"comm_hook must be one of {', '.join(COMM_HOOKS)} or None; received {self.comm_hook!r}")
        for name in ("powersgd_rank", "model_averaging_period"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValueError(f"{name} must be a positive integer; received {value!r}")
        for name in ("powersgd_start_step", "model_averaging_warmup"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{name} must be an integer >= 0; received {value!r}")
        if self.comm_hook is not None and self.model_averaging_period is not None:
            raise ValueError("model averaging replaces DDP's gradient all-reduce with its own hook, so it cannot be "
                             "combined with comm_hook; pass one of comm_hook= or model_averaging_period=")

    @property
    def active(self) -> bool:
        return self.comm_hook is not None or self.model_averaging_period is not None

    def check_backend(self, backend: str) -> None:
        """bf16 all-reduce needs NCCL: say so before the processes train."""
        if self.comm_hook == "bf16" and backend != "nccl":
            raise ValueError(f"comm_hook='bf16' needs the nccl backend (CUDA 11+, NCCL 2.10+); this run uses "
                             f"{backend!r}. Use comm_hook='fp16' on the CPU (gloo).")


@functools.cache
def local_sgd_optimizer_class() -> type:
    """torch's PostLocalSGDOptimizer, with `param_groups` that follow the inner optimizer after `load_state_dict`
    (which replaces them), so LR scaling and schedules keep acting on the groups that step. Built on first use:
    importing torch.distributed.optim is slow and noisy."""
    from torch.distributed.optim import PostLocalSGDOptimizer

    class LocalSGDOptimizer(PostLocalSGDOptimizer):
        def load_state_dict(self, state_dict) -> None:
            super().load_state_dict(state_dict)
            self.param_groups = self.optim.param_groups

    return LocalSGDOptimizer


class WarmupCount:
    """Post-local SGD's hook state as a checkpoint keeps it: its step count, which ends the warmup."""

    def __init__(self, state):
        self.state = state

    def state_dict(self) -> dict:
        return {"iter": self.state.iter}

    def load_state_dict(self, saved: dict) -> None:
        self.state.iter = saved["iter"]


def configure_communication(net: DistributedDataParallel, optimizer: torch.optim.Optimizer,
                            options: CommOptions) -> tuple[torch.optim.Optimizer, object | None]:
    """Register the communication hook on the DDP-wrapped `net`; return the optimizer to train with and the hook's
    state in a form with `state_dict()` / `load_state_dict()` for checkpoints (None for the stateless fp16 / bf16
    hooks)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, post_localSGD_hook, powerSGD_hook
    from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager

    if options.comm_hook == "fp16":
        net.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif options.comm_hook == "bf16":
        net.register_comm_hook(None, default_hooks.bf16_compress_hook)
    elif options.comm_hook == "powersgd":
        from easyfit.distributed.strategy_parts.powersgd_state import LaidOutPowerSGD
        state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=options.powersgd_rank,
                                            start_powerSGD_iter=options.powersgd_start_step)
        hook = LaidOutPowerSGD(state, net.module)
        net.register_comm_hook(state, hook.hook)
        return optimizer, hook
    if options.model_averaging_period is None:
        return optimizer, None
    # one subgroup per rank: after the warmup, the gradient "all-reduce" is local. Given explicitly, because torch's
    # default (one subgroup per machine) counts CUDA devices and fails on a machine without them.
    alone, _ = dist.new_subgroups(group_size=1)
    state = post_localSGD_hook.PostLocalSGDState(process_group=None, subgroup=alone,
                                                 start_localSGD_iter=options.model_averaging_warmup)
    net.register_comm_hook(state, post_localSGD_hook.post_localSGD_hook)
    averager = PeriodicModelAverager(period=options.model_averaging_period,
                                     warmup_steps=options.model_averaging_warmup)
    return local_sgd_optimizer_class()(optimizer, averager), WarmupCount(state)
