"""DistributedDataParallel: one process per device, gradients all-reduced during backward.

One class serves four names, differing only in how ranks start: "ddp" re-runs the script (or joins an external
launch such as torchrun or SLURM), "ddp_spawn" spawns fresh processes, "ddp_fork" / "ddp_notebook" fork this one.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from easyfit.distributed.strategies.base import FitState
from easyfit.distributed.strategies.parallel import ParallelStrategy
from easyfit.distributed.strategy_parts.ddp_comm import CommOptions, configure_communication

COMMUNICATION_KEY = "communication"   # the checkpoint's entry for every rank's communication hook state


@dataclass
class DDPFit(FitState):
    """A DDP fit: the DistributedDataParallel net it trains, and its communication hook's state (None: no hook, or a
    stateless one)."""

    wrapped: DistributedDataParallel
    hook_state: object | None


class DDPStrategy(ParallelStrategy):
    """torch DistributedDataParallel; `start_method` is "popen" (script re-launch), "spawn" or "fork".

    `gradient_as_bucket_view` (True): the gradients are views into DDP's all-reduce buckets, so the device holds one
    copy of them, not two (the numbers are the same; code that calls `param.grad.detach_()` needs False)."""

    START_METHODS = {"popen": "ddp", "spawn": "ddp_spawn", "fork": "ddp_fork"}

    def __init__(self, *args, start_method: str = "popen", find_unused_parameters: bool = False,
                 sync_batchnorm: bool = False, name: str | None = None, comm_hook: str | None = None,
                 powersgd_rank: int = 1, powersgd_start_step: int = 10, model_averaging_period: int | None = None,
                 model_averaging_warmup: int = 0, gradient_as_bucket_view: bool = True, **kwargs):
        if start_method not in self.START_METHODS:
            raise ValueError(f"start_method must be one of {', '.join(self.START_METHODS)}, got {start_method!r}")
        super().__init__(*args, **kwargs)
        #: compressed gradients / local SGD (see ddp_comm); inactive by default
        self.communication = CommOptions(comm_hook, powersgd_rank, powersgd_start_step, model_averaging_period,
                                         model_averaging_warmup)
        self.start_method = start_method
        self.find_unused_parameters, self.sync_batchnorm = find_unused_parameters, sync_batchnorm
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.name = name or self.START_METHODS[start_method]

    @property
    def starts_processes(self) -> bool:
        return self.start_method != "popen"

    @property
    def supports_compile(self) -> bool:
        """A compiled step under DDP; not with a communication hook (PowerSGD, post-local SGD), whose state and
        optimizer wrapper the compiled graphs do not cover."""
        return not self.communication.active

    def compile_context(self) -> contextlib.AbstractContextManager:
        """dynamo's DDP optimizer: the compiled graph is split at DDP's bucket boundaries, so each bucket's
        gradient all-reduce starts while the backward of the rest still runs."""
        from easyfit.utils.torch_internals import ddp_optimizer
        return ddp_optimizer()

    def check_call(self, call) -> None:
        self.communication.check_backend(self.process_group_backend or call.process_group_backend
                                         or ("nccl" if call.accelerator == "cuda" else "gloo"))
        if self.start_method == "popen" and call.interactive and not call.external and len(call.devices) > 1:
            raise ValueError(f"strategy={self.name!r} re-runs your script in each extra process, but this is a "
                             "notebook or REPL. Use strategy='ddp_notebook' (fork) here, or run the code as a script.")

    def start_launcher(self):
        if self.start_method == "popen":
            return super().start_launcher()
        from easyfit.distributed.launchers import ProcessLauncher
        return ProcessLauncher(self, self.start_method)

    def setup(self, net: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler=None):
        if self.sync_batchnorm:
            net = torch.nn.SyncBatchNorm.convert_sync_batchnorm(net)
        net, optimizer, scheduler = super().setup(net, optimizer, scheduler)
        device_ids = [self.root_device.index] if self.root_device.type == "cuda" else None
        wrapped = DistributedDataParallel(net, device_ids=device_ids,
                                          find_unused_parameters=self.find_unused_parameters,
                                          gradient_as_bucket_view=self.gradient_as_bucket_view)
        hook_state = None
        if self.communication.active:
            optimizer, hook_state = configure_communication(wrapped, optimizer, self.communication)
        self.fit_state = DDPFit(wrapped, hook_state)
        return wrapped, optimizer, scheduler

    def _ddp_fit(self) -> DDPFit | None:
        """The running fit's DDP state; None outside a fit, or in a subclass's fit that trains without DDP's wrapper
        (FSDP, DeepSpeed, FairScale)."""
        return self.fit_state if isinstance(self.fit_state, DDPFit) else None

    def backward(self, loss: torch.Tensor, precision) -> None:
        """A parameter that got no gradient on this rank leaves DDP's all-reduce unfinished: raise DDP's error now,
        before another collective meets the peers' pending all-reduce (gloo then aborts the process)."""
        super().backward(loss, precision)
        fit = self._ddp_fit()
        if fit is not None and not self.find_unused_parameters:
            fit.wrapped._check_reducer_finalized()

    def save_checkpoint(self, path: str, state: dict) -> None:
        """With a stateful communication hook (PowerSGD, post-local SGD), every rank's hook state goes into the
        checkpoint too (PowerSGD's error feedback differs per rank), so a resume continues exactly."""
        fit = self._ddp_fit()
        if fit is not None and fit.hook_state is not None:
            states = [None] * self.world_size
            dist.all_gather_object(states, fit.hook_state.state_dict())
            state = {**state, COMMUNICATION_KEY: states}
        super().save_checkpoint(path, state)

    def load_checkpoint(self, path: str) -> dict:
        state = super().load_checkpoint(path)
        saved, fit = state.pop(COMMUNICATION_KEY, None), self._ddp_fit()
        if saved is not None and fit is not None and fit.hook_state is not None and len(saved) == self.world_size:
            fit.hook_state.load_state_dict(saved[self.global_rank])
        return state

    def module_for_eval(self, net: torch.nn.Module) -> torch.nn.Module:
        """The training net (validation in a fit) takes rank 0's buffers first, as DDP gives them to every rank at
        its next forward: the ranks evaluate one net, the one rank 0's checkpoints hold."""
        if isinstance(net, DistributedDataParallel):
            from easyfit.distributed.strategy_parts.buffers import share_rank_zero_buffers
            share_rank_zero_buffers(self, net.module)
        return super().module_for_eval(net)

    def no_sync(self, net: torch.nn.Module) -> contextlib.AbstractContextManager:
        return net.no_sync() if isinstance(net, DistributedDataParallel) else contextlib.nullcontext()

    def uneven_inputs(self, net: torch.nn.Module) -> contextlib.AbstractContextManager:
        """torch's join: a rank whose data ran out shadows the gradient all-reduces of the others (which divide by
        the whole world size), and every rank ends the epoch with the same weights."""
        return net.join() if isinstance(net, DistributedDataParallel) else contextlib.nullcontext()
