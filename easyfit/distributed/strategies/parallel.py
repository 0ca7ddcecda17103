"""What every multi-process strategy shares: its configuration (devices, nodes, who starts the processes) and each
rank's share of the CPU cores (`MultiProcessStrategy`, also Horovod's), and with torch.distributed (`ParallelStrategy`)
the ranks, the process group, the data-parallel share of the data and the collectives."""
from __future__ import annotations

import atexit
import contextlib
import gc
import os
import sys
import threading
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.utils.data import DistributedSampler, Sampler

from easyfit.distributed.attempt_store import attempt_store
from easyfit.distributed.collectives import TorchCollectives
from easyfit.distributed.environments import ClusterEnvironment, LocalEnvironment
from easyfit.distributed.strategies.base import CallState, Strategy
from easyfit.distributed.strategy_parts.cpu_threads import CoreShare

DEFAULT_TIMEOUT = timedelta(minutes=10)
#: how long joining the process group may take before easyfit says which peers it still waits for, and why
PEER_WAIT_NOTICE_SECONDS = 15.0


def destroy_subgroups(groups: list) -> None:
    """End process groups made besides the default one, on every rank in the same order (the last made first); the
    default group and groups this rank is not in are left alone."""
    if not dist.is_initialized():
        return
    for group in reversed(groups):
        if group is not dist.GroupMember.NON_GROUP_MEMBER and group != dist.group.WORLD:
            dist.destroy_process_group(group)


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


class DataParallelShares:
    """The sampler hooks of a strategy whose data-parallel replicas each train on a share of the data: replica
    `data_parallel_rank` of `data_parallel_size` (Strategy's properties; a strategy whose ranks form groups that
    see the same batch, as a pipeline's stages, says so there, and these hooks follow)."""

    def train_sampler(self, dataset_len: int, shuffle: bool, seed: int) -> Sampler:
        return DistributedSampler(range(dataset_len), num_replicas=self.data_parallel_size,
                                  rank=self.data_parallel_rank, shuffle=shuffle, seed=seed)

    def wrap_user_sampler(self, sampler: Sampler) -> Sampler:
        return DistributedSamplerWrapper(sampler, self.data_parallel_rank, self.data_parallel_size)


@dataclass
class ParallelCall(CallState):
    """A call of several processes: this rank's share of the CPU cores while it runs, and the process groups it made
    besides the default one (a pipeline's), which end with the call."""

    cores: CoreShare = field(default_factory=CoreShare)
    subgroups: list = field(default_factory=list)


class MultiProcessStrategy(DataParallelShares, Strategy):
    """The configuration every multi-process strategy shares (the devices of each node, the nodes, who starts the
    processes, the process-group backend), and each rank's share of the CPU cores while a call runs."""

    def __init__(self, accelerator: str | None = None, parallel_devices: list[torch.device] | None = None,
                 num_nodes: int | None = None, environment: ClusterEnvironment | None = None,
                 process_group_backend: str | None = None):
        self.accelerator, self.parallel_devices, self.num_nodes = accelerator, parallel_devices, num_nodes
        self.environment, self.process_group_backend = environment, process_group_backend

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

    @property
    def num_processes(self) -> int:
        """Processes on this node."""
        return len(self.parallel_devices)

    def new_call_state(self) -> ParallelCall:
        """The state of a call starting in this process (a backend with more to hold gives its own)."""
        return ParallelCall()

    def setup_environment(self) -> None:
        super().setup_environment()
        self.call_state = self.new_call_state()

    def end_fit(self, user_net: torch.nn.Module, user_optimizer: torch.optim.Optimizer, net, optimizer) -> None:
        """Rank 0's buffers into every rank's net (BatchNorm's running statistics, which each rank updated from its
        own batches): the net is the same in every process after the fit, the one rank 0's checkpoints hold."""
        from easyfit.distributed.strategy_parts.buffers import share_rank_zero_buffers
        share_rank_zero_buffers(self, user_net)
        super().end_fit(user_net, user_optimizer, net, optimizer)

    def share_cores(self, processes: int) -> None:
        """This rank's share of the CPU cores, one of `processes` on this machine, while the call runs."""
        self.call_state.cores.apply(processes)

    @property
    def threads_note(self) -> str | None:
        return None if self.call_state is None else self.call_state.cores.note

    def teardown(self) -> None:
        if self.call_state is not None:
            self.call_state.cores.restore()
        super().teardown()


class ParallelStrategy(MultiProcessStrategy):
    """What every multi-process strategy of torch.distributed shares: ranks, the process group, samplers and
    collectives."""

    def __init__(self, accelerator: str | None = None, parallel_devices: list[torch.device] | None = None,
                 num_nodes: int | None = None, environment: ClusterEnvironment | None = None,
                 process_group_backend: str | None = None, timeout: timedelta = DEFAULT_TIMEOUT):
        super().__init__(accelerator, parallel_devices, num_nodes, environment, process_group_backend)
        self.timeout = timeout
        self._local_rank = 0

    # --- identity -------------------------------------------------------------------
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
    def make_launcher(self):
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
            self.share_cores(self.num_processes)
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

    def teardown(self) -> None:
        """The call's own process groups end with it; processes this strategy started end with the default group
        too, which a re-launched script keeps for later calls."""
        if self.call_state is not None:
            destroy_subgroups(self.call_state.subgroups)
        super().teardown()
        if self._group_ends_with_call():
            destroy_process_group()

    # --- collectives ----------------------------------------------------------------
    @property
    def collectives(self) -> TorchCollectives:
        return TorchCollectives(self.world_size, self._collective_device)

    def reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        return self.collectives.reduce(tensor, op, self.reduce_group(op))

    def reduce_group(self, op: str) -> dist.ProcessGroup | None:
        """The process group `reduce` runs `op` over (None: every rank)."""
        return None

    @property
    def _collective_device(self) -> torch.device:
        """Where tensors must be for the process group's backend: NCCL takes CUDA tensors only."""
        if self.process_group_backend == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def __repr__(self) -> str:
        per_node = None if self.parallel_devices is None else self.num_processes   # None: not configured yet
        return (f"{type(self).__name__}(accelerator={self.accelerator!r}, processes_per_node={per_node}, "
                f"num_nodes={self.num_nodes}, backend={self.process_group_backend!r})")
