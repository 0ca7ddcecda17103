"""DistributedDataParallel: one process per device, gradients all-reduced during backward.

One class serves four names, differing only in how ranks start: "ddp" re-runs the script (or joins an external
launch such as torchrun or SLURM), "ddp_spawn" spawns fresh processes, "ddp_fork" / "ddp_notebook" fork this one.
"""
from __future__ import annotations

import atexit
import contextlib
import gc
import os
import sys
import threading
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DistributedSampler, Sampler

from easyfit.distributed.attempt_store import attempt_store
from easyfit.distributed.environments import ClusterEnvironment, LocalEnvironment
from easyfit.distributed.strategies.base import Strategy
from easyfit.distributed.strategy_parts.cpu_threads import CoreShare
from easyfit.distributed.strategy_parts.ddp_comm import CommOptions, configure_communication

DEFAULT_TIMEOUT = timedelta(minutes=10)
#: how long joining the process group may take before easyfit says which peers it still waits for, and why
PEER_WAIT_NOTICE_SECONDS = 15.0
REDUCE_OPS = {"sum": "SUM", "mean": "SUM", "max": "MAX", "min": "MIN"}
COMMUNICATION_KEY = "communication"   # the checkpoint's entry for every rank's communication hook state


def destroy_process_group() -> None:
    """Destroy the default process group while the interpreter is fully alive. The DDP wrapper of the last call sits
    in reference cycles that still hold the group; they are collected first, so the group is not freed during
    interpreter shutdown, which can abort the process ("terminate called without an active exception")."""
    if dist.is_initialized():
        gc.collect()
        dist.destroy_process_group()


@contextlib.contextmanager
def _say_who_is_missing(strategy: ParallelStrategy, after_seconds: float):
    """While joining the process group, print after a while which ranks are awaited and the likely cause, so a
    launch that started too few processes does not wait in silence."""
    def notice() -> None:
        environment = strategy.environment
        others = [rank for rank in range(strategy.world_size) if rank != strategy.global_rank]
        print(f"easyfit: rank {strategy.global_rank} has waited {after_seconds:.0f} s for rank(s) "
              f"{', '.join(map(str, others))} to join the process group of {strategy.world_size} at "
              f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')} ({environment.name}). "
              f"{environment.missing_peers_hint(strategy.world_size)}", file=sys.stderr, flush=True)

    timer = threading.Timer(after_seconds, notice)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


class DistributedSamplerWrapper(Sampler):
    """A user's sampler split between ranks: each rank takes every world_size-th index the sampler yields."""

    def __init__(self, sampler: Sampler, rank: int, world_size: int):
        self.sampler, self.rank, self.world_size = sampler, rank, world_size

    def set_epoch(self, epoch: int) -> None:
        if hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(epoch)

    def __iter__(self):
        indices = list(self.sampler)
        indices += indices[:(-len(indices)) % self.world_size]   # pad so every rank takes as many steps
        return iter(indices[self.rank::self.world_size])

    def __len__(self) -> int:
        return -(-len(self.sampler) // self.world_size)


class ParallelStrategy(Strategy):
    """What every multi-process strategy shares: ranks, the process group, samplers and collectives."""

    def __init__(self, accelerator: str | None = None, parallel_devices: list[torch.device] | None = None,
                 num_nodes: int | None = None, environment: ClusterEnvironment | None = None,
                 process_group_backend: str | None = None, timeout: timedelta = DEFAULT_TIMEOUT):
        self.accelerator, self.parallel_devices, self.num_nodes = accelerator, parallel_devices, num_nodes
        self.environment, self.process_group_backend = environment, process_group_backend
        self.timeout = timeout
        self._local_rank = 0
        self.cores = CoreShare()   # this rank's share of the CPU cores while a call runs

    def configure(self, accelerator: str = "cpu", parallel_devices: list[torch.device] | None = None,
                  num_nodes: int = 1, environment: ClusterEnvironment | None = None,
                  process_group_backend: str | None = None) -> None:
        """Fill in every setting the user left unset; the connector calls this with what the call asked for."""
        self.accelerator = self.accelerator or accelerator
        self.parallel_devices = self.parallel_devices or parallel_devices or [torch.device(self.accelerator)]
        self.num_nodes = self.num_nodes or num_nodes
        self.environment = self.environment or environment or LocalEnvironment()
        self.process_group_backend = (self.process_group_backend or process_group_backend
                                      or ("nccl" if self.accelerator == "cuda" else "gloo"))

    # --- identity -------------------------------------------------------------------
    @property
    def num_processes(self) -> int:
        """Processes on this node."""
        return len(self.parallel_devices)

    @property
    def world_size(self) -> int:
        if self.environment.creates_processes_externally:
            return self.environment.world_size()
        return self.num_nodes * self.num_processes

    @property
    def local_rank(self) -> int:
        return self.environment.local_rank() if self.environment.creates_processes_externally else self._local_rank

    @property
    def node_rank(self) -> int:
        return self.environment.node_rank()

    @property
    def global_rank(self) -> int:
        if self.environment.creates_processes_externally:
            return self.environment.global_rank()
        return self.node_rank * self.num_processes + self._local_rank

    def set_local_rank(self, local_rank: int) -> None:
        """Called in each process started by a ProcessLauncher."""
        self._local_rank = local_rank

    @property
    def root_device(self) -> torch.device:
        return self.parallel_devices[self.local_rank % self.num_processes]

    # --- life -----------------------------------------------------------------------
    @property
    def launcher(self):
        """The launcher that starts this call's ranks; in a rank that exists already, the handshake of the launcher
        that started it (if easyfit's own) or None."""
        if self.environment.creates_processes_externally:
            from easyfit.distributed.launchers import existing_rank_launcher
            return existing_rank_launcher(self.environment)
        return self.start_launcher()

    def start_launcher(self):
        """The launcher that creates this call's ranks: the script re-run for the other local ranks."""
        from easyfit.distributed.launchers import ScriptLauncher
        return ScriptLauncher(self) if self.num_processes > 1 else None

    def setup_environment(self) -> None:
        super().setup_environment()
        if self.root_device.type == "cpu" and self.launcher is not None:   # easyfit's own launch, not torchrun's
            self.cores.apply(self.num_processes)
        if dist.is_initialized():
            if dist.get_world_size() != self.world_size:
                raise RuntimeError(f"a process group of {dist.get_world_size()} processes already exists, but this "
                                   f"call needs {self.world_size}; use the same devices and num_nodes throughout")
            return
        if self.world_size == 1:   # one process meets no one: no port is taken, none is left in the environment
            store = dist.HashStore()
        else:
            os.environ.setdefault("MASTER_ADDR", self.environment.main_address)
            os.environ.setdefault("MASTER_PORT", str(self.environment.main_port))
            store = attempt_store(self.environment, self.world_size, self.global_rank, self.timeout)
        with _say_who_is_missing(self, after_seconds=PEER_WAIT_NOTICE_SECONDS):
            dist.init_process_group(self.process_group_backend, store=store, rank=self.global_rank,
                                    world_size=self.world_size, timeout=self.timeout)
        if not self._group_ends_with_call():   # kept for later calls: destroyed when the script ends
            atexit.register(destroy_process_group)

    def _group_ends_with_call(self) -> bool:
        """True in processes a spawn / fork launcher started for this call alone."""
        return self.launcher is not None and not self.launcher.rank_zero_in_caller

    @property
    def threads_note(self) -> str | None:
        return self.cores.note

    def teardown(self) -> None:
        """Processes this strategy started end with their group; a re-launched script keeps it for later calls."""
        self.cores.restore()
        if self._group_ends_with_call():
            destroy_process_group()

    # --- data -----------------------------------------------------------------------
    def train_sampler(self, dataset_len: int, shuffle: bool, seed: int) -> Sampler:
        return DistributedSampler(range(dataset_len), num_replicas=self.world_size, rank=self.global_rank,
                                  shuffle=shuffle, seed=seed)

    def wrap_user_sampler(self, sampler: Sampler) -> Sampler:
        return DistributedSamplerWrapper(sampler, self.global_rank, self.world_size)

    # --- collectives ----------------------------------------------------------------
    def reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        if op not in REDUCE_OPS:
            raise ValueError(f"reduce op must be one of {', '.join(REDUCE_OPS)}, got {op!r}")
        result = tensor.to(self._collective_device, copy=True)
        dist.all_reduce(result, op=getattr(dist.ReduceOp, REDUCE_OPS[op]))
        result = result.to(tensor.device)
        return result / self.world_size if op == "mean" else result

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's tensor. Their first dimensions may differ, and a rank may hold none (an empty tensor of any
        shape): the tensors are padded to the longest for the transfer and trimmed after."""
        if tensor.dim() == 0:   # a scalar (e.g. a metric's running sum): gathered as one element
            return [part.reshape(()) for part in self.all_gather(tensor.reshape(1))]
        device = self._collective_device
        meta = [None] * self.world_size
        dist.all_gather_object(meta, (len(tensor), tuple(tensor.shape[1:]), tensor.dtype))
        trailing, dtype = next(((shape, dtype) for length, shape, dtype in meta if length), meta[0][1:])
        padded = torch.zeros((max(length for length, _, _ in meta), *trailing), dtype=dtype, device=device)
        if len(tensor):   # a rank with no rows (fewer samples than processes) sends padding only
            padded[:len(tensor)] = tensor.to(device)
        gathered = [torch.empty_like(padded) for _ in meta]
        dist.all_gather(gathered, padded)
        return [part[:length].to(tensor.device) for part, (length, _, _) in zip(gathered, meta)]

    @property
    def _collective_device(self) -> torch.device:
        """Where tensors must be for the process group's backend: NCCL takes CUDA tensors only."""
        if self.process_group_backend == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        holder = [obj]
        dist.broadcast_object_list(holder, src=src)
        return holder[0]

    def barrier(self) -> None:
        if dist.is_initialized():
            dist.barrier()

    def __repr__(self) -> str:
        per_node = None if self.parallel_devices is None else self.num_processes   # None: not configured yet
        return (f"{type(self).__name__}(accelerator={self.accelerator!r}, processes_per_node={per_node}, "
                f"num_nodes={self.num_nodes}, backend={self.process_group_backend!r})")


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
        self._hook_state = None
        self._ddp_net: DistributedDataParallel | None = None   # the net of the running fit
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
        import torch._dynamo
        return torch._dynamo.config.patch(optimize_ddp="ddp_optimizer")

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
        if self.communication.active:
            optimizer, self._hook_state = configure_communication(wrapped, optimizer, self.communication)
        self._ddp_net = wrapped
        return wrapped, optimizer, scheduler

    def backward(self, loss: torch.Tensor, precision) -> None:
        """A parameter that got no gradient on this rank leaves DDP's all-reduce unfinished: raise DDP's error now,
        before another collective meets the peers' pending all-reduce (gloo then aborts the process)."""
        super().backward(loss, precision)
        if self._ddp_net is not None and not self.find_unused_parameters:
            self._ddp_net._check_reducer_finalized()

    def save_checkpoint(self, path: str, state: dict) -> None:
        """With a stateful communication hook (PowerSGD, post-local SGD), every rank's hook state goes into the
        checkpoint too (PowerSGD's error feedback differs per rank), so a resume continues exactly."""
        if self._hook_state is not None:
            states = [None] * self.world_size
            dist.all_gather_object(states, self._hook_state.state_dict())
            state = {**state, COMMUNICATION_KEY: states}
        super().save_checkpoint(path, state)

    def load_checkpoint(self, path: str) -> dict:
        state = super().load_checkpoint(path)
        saved = state.pop(COMMUNICATION_KEY, None)
        if saved is not None and self._hook_state is not None and len(saved) == self.world_size:
            self._hook_state.load_state_dict(saved[self.global_rank])
        return state

    def no_sync(self, net: torch.nn.Module) -> contextlib.AbstractContextManager:
        return net.no_sync() if isinstance(net, DistributedDataParallel) else contextlib.nullcontext()

    def uneven_inputs(self, net: torch.nn.Module) -> contextlib.AbstractContextManager:
        """torch's join: a rank whose data ran out shadows the gradient all-reduces of the others (which divide by
        the whole world size), and every rank ends the epoch with the same weights."""
        return net.join() if isinstance(net, DistributedDataParallel) else contextlib.nullcontext()
