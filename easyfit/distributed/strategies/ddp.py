"""DistributedDataParallel: one process per device, gradients all-reduced during backward.

`DDPWrapping` is how a net is wrapped in torch's DistributedDataParallel, composed into the strategies that train
through it (DDPStrategy, and ZeroStrategy, which adds an optimizer sharded over the ranks; what the wrapper needs
around a step and an evaluation is their common base's, ParallelStrategy). One strategy
class serves four names, differing only in how ranks start: "ddp" re-runs the script (or joins an external launch
such as torchrun or SLURM), "ddp_spawn" spawns fresh processes, "ddp_fork" / "ddp_notebook" fork this one.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from easyfit.distributed.strategies.capabilities import Capabilities
from easyfit.distributed.strategies.parallel import ParallelStrategy
from easyfit.distributed.strategies.states import Fit
from easyfit.distributed.strategy_parts.ddp_comm import CommOptions, configure_communication

COMMUNICATION_KEY = "communication"   # the checkpoint's entry for every rank's communication hook state


@dataclass(frozen=True)
class DDPWrapping:
    """How a net is wrapped in DistributedDataParallel: the wrapper's options.

    `gradient_as_bucket_view` (True): the gradients are views into DDP's all-reduce buckets, so the device holds one
    copy of them, not two (the numbers are the same; code that calls `param.grad.detach_()` needs False)."""

    find_unused_parameters: bool = False
    sync_batchnorm: bool = False
    gradient_as_bucket_view: bool = True

    def prepare(self, net: torch.nn.Module) -> torch.nn.Module:
        """The net before it moves to its device: its BatchNorm layers synchronised over the ranks if asked."""
        return torch.nn.SyncBatchNorm.convert_sync_batchnorm(net) if self.sync_batchnorm else net

    def wrap(self, net: torch.nn.Module, device: torch.device) -> DistributedDataParallel:
        """The net (on `device`) in DistributedDataParallel."""
        return DistributedDataParallel(net, device_ids=[device.index] if device.type == "cuda" else None,
                                       find_unused_parameters=self.find_unused_parameters,
                                       gradient_as_bucket_view=self.gradient_as_bucket_view)

    def check_backward(self, wrapped: DistributedDataParallel) -> None:
        """A parameter that got no gradient on this rank leaves DDP's all-reduce unfinished: raise DDP's error now,
        before another collective meets the peers' pending all-reduce (gloo then aborts the process)."""
        if not self.find_unused_parameters:
            wrapped._check_reducer_finalized()


@dataclass(kw_only=True)
class DDPFit(Fit):
    """A DDP fit: its net is the DistributedDataParallel wrapper; its communication hook's state (None: no hook, or
    a stateless one)."""

    hook_state: object | None = None


class DDPStrategy(ParallelStrategy):
    """torch DistributedDataParallel; `start_method` is "popen" (script re-launch), "spawn" or "fork".

    `find_unused_parameters`, `sync_batchnorm`, `gradient_as_bucket_view`: the wrapper's options (see
    DDPWrapping); `comm_hook` and the rest: compressed gradients / local SGD (see ddp_comm). The
    placement options (devices, nodes, environment, process-group backend, timeout) are ParallelStrategy's."""

    capabilities = Capabilities(supports_compile=True)
    NAMES = {"popen": "ddp", "spawn": "ddp_spawn", "fork": "ddp_fork"}

    def __init__(self, *, start_method: str = "popen", find_unused_parameters: bool = False,
                 sync_batchnorm: bool = False, name: str | None = None, comm_hook: str | None = None,
                 powersgd_rank: int = 1, powersgd_start_step: int = 10, model_averaging_period: int | None = None,
                 model_averaging_warmup: int = 0, gradient_as_bucket_view: bool = True, **placement):
        super().__init__(start_method=start_method, **placement)
        self.wrapping = DDPWrapping(find_unused_parameters, sync_batchnorm, gradient_as_bucket_view)
        #: compressed gradients / local SGD (see ddp_comm); inactive by default
        self.communication = CommOptions(comm_hook, powersgd_rank, powersgd_start_step, model_averaging_period,
                                         model_averaging_warmup)
        if self.communication.active:   # the compiled graphs do not cover a hook's state and optimizer wrapper
            self.capabilities = replace(self.capabilities, supports_compile=False)
        self.name = name or self.NAMES[start_method or "popen"]

    def compile_context(self) -> contextlib.AbstractContextManager:
        """dynamo's DDP optimizer: the compiled graph is split at DDP's bucket boundaries, so each bucket's
        gradient all-reduce starts while the backward of the rest still runs."""
        from easyfit.utils.torch_internals import ddp_optimizer
        return ddp_optimizer()

    def check_call(self, call) -> None:
        self.communication.check_backend(self.process_group_backend or call.process_group_backend
                                         or ("nccl" if call.accelerator == "cuda" else "gloo"))
        super().check_call(call)

    def setup(self, net: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler=None, settings=None,
              call=None) -> DDPFit:
        fit = super().setup(self.wrapping.prepare(net), optimizer, scheduler, settings, call)
        wrapped = self.wrapping.wrap(fit.net, self.root_device)
        hook_state = None
        if self.communication.active:
            optimizer, hook_state = configure_communication(wrapped, optimizer, self.communication)
        return DDPFit(strategy=self, net=wrapped, optimizer=optimizer, scheduler=scheduler, call=call,
                      hook_state=hook_state)

    def backward(self, fit: Fit, loss: torch.Tensor, precision) -> None:
        super().backward(fit, loss, precision)
        if isinstance(fit, DDPFit):
            self.wrapping.check_backward(fit.net)

    def save_checkpoint(self, fit: Fit, path: str, state: dict) -> None:
        """With a stateful communication hook (PowerSGD, post-local SGD), every rank's hook state goes into the
        checkpoint too (PowerSGD's error feedback differs per rank), so a resume continues exactly."""
        if getattr(fit, "hook_state", None) is not None:
            states = [None] * self.world_size
            dist.all_gather_object(states, fit.hook_state.state_dict())
            state = {**state, COMMUNICATION_KEY: states}
        super().save_checkpoint(fit, path, state)

    def load_checkpoint(self, fit: Fit, path: str) -> dict:
        state = super().load_checkpoint(fit, path)
        saved, hook_state = state.pop(COMMUNICATION_KEY, None), getattr(fit, "hook_state", None)
        if saved is not None and hook_state is not None and len(saved) == self.world_size:
            hook_state.load_state_dict(saved[self.global_rank])
        return state
