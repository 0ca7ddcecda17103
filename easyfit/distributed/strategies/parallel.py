"""What every multi-process strategy shares (`ParallelStrategy`): its configuration (devices, nodes, who starts the
processes and how, and this rank's placement: the ranks, read from the launch environment once when the call's
strategy is configured for this process, and frozen), each rank's share of the CPU cores and of the data, and the
process group it joins (torch.distributed's here, with its collectives; Horovod joins its own job instead)."""
from __future__ import annotations

import atexit
import contextlib
import gc
import os
import sys
import threading
from dataclasses import dataclass, field, replace
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DistributedSampler, Sampler

from easyfit.distributed.attempt_store import attempt_store
from easyfit.distributed.collectives import TorchCollectives
from easyfit.distributed.environments import ClusterEnvironment, LocalEnvironment
from easyfit.distributed.strategies.base import CallState, Strategy
from easyfit.distributed.strategies.states import NOT_LAUNCHED, Fit, Launched
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


@dataclass(frozen=True)
class Placement:
    """Where one call runs in this process: its ranks, read from the launch environment once, when the call's
    strategy is configured for this process (`ParallelStrategy.configure`, or `configure_rank` in a process a
    launcher started for one rank), and frozen with that configuration."""

    world_size: int
    global_rank: int
    local_rank: int
    node_rank: int


@dataclass
class ParallelCall(CallState):
    """A call of several processes in this process: this rank's share of the CPU cores while it runs (ranks
    easyfit's launcher started share this machine's), and the process groups it made besides the default one (a
    pipeline's), which end with the call (the default one too in processes started for this call alone)."""

    cores: CoreShare = field(default_factory=CoreShare)
    subgroups: list = field(default_factory=list)

    @property
    def threads_note(self) -> str | None:
        return self.cores.note


#: how a strategy's own launcher starts the other ranks: re-running the script, spawning or forking processes
START_METHODS = ("popen", "spawn", "fork")


class ParallelStrategy(Strategy):
    """What every multi-process strategy shares: the devices of each node, the nodes, the launch environment, the
    process-group backend and how the ranks start (`start_method`: "popen" re-runs the script, "spawn" / "fork" start
    new processes; None: the script is re-run, the strategy offering no other way); this rank's frozen placement, its
    share of the CPU cores and of the data, the process group and the collectives."""

    #: this rank's placement, frozen when the strategy is configured for this process (`freeze`)
    placement: Placement | None = None

    def __init__(self, accelerator: str | None = None, parallel_devices: list[torch.device] | None = None,
                 num_nodes: int | None = None, environment: ClusterEnvironment | None = None,
                 process_group_backend: str | None = None, timeout: timedelta = DEFAULT_TIMEOUT,
                 start_method: str | None = None):
        if start_method is not None and start_method not in START_METHODS:
            raise ValueError(f"start_method must be one of {', '.join(START_METHODS)}, got {start_method!r}")
        self.accelerator, self.parallel_devices, self.num_nodes = accelerator, parallel_devices, num_nodes
        self.environment, self.process_group_backend = environment, process_group_backend
        self.timeout, self.start_method = timeout, start_method
        if start_method in ("spawn", "fork"):
            self.capabilities = replace(self.capabilities, starts_processes=True)

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
        self.freeze(self.read_placement())

    def configure_rank(self, local_rank: int) -> None:
        """In a process a launcher started for one rank (spawn, fork), before its call: that rank's placement."""
        self.freeze(self.read_placement(local_rank))

    def freeze(self, placement: Placement) -> None:
        """Keep this rank's placement, and its device, as plain values: what the process's calls read from here on."""
        self.placement = placement
        self.world_size, self.global_rank = placement.world_size, placement.global_rank
        self.local_rank, self.node_rank = placement.local_rank, placement.node_rank
        self.root_device = self.parallel_devices[placement.local_rank % self.num_processes]

    @property
    def num_processes(self) -> int:
        """Processes on this node."""
        return len(self.parallel_devices)

    # --- placement ------------------------------------------------------------------
    def read_placement(self, local_rank: int = 0) -> Placement:
        """The ranks as the launch environment says (a launcher's variables), or as this process's own launch makes
        them (`local_rank`: the one its launcher gave it); read once, when the strategy is configured."""
        environment = self.environment
        node_rank = environment.node_rank()
        if environment.creates_processes_externally:
            return Placement(environment.world_size(), environment.global_rank(), environment.local_rank(), node_rank)
        return Placement(self.num_nodes * self.num_processes, node_rank * self.num_processes + local_rank,
                         local_rank, node_rank)

    # --- data: this replica's share -----------------------------------------------------
    def train_sampler(self, dataset_len: int, shuffle: bool, seed: int) -> Sampler:
        return DistributedSampler(range(dataset_len), num_replicas=self.data_parallel_size,
                                  rank=self.data_parallel_rank, shuffle=shuffle, seed=seed)

    def wrap_user_sampler(self, sampler: Sampler) -> Sampler:
        return DistributedSamplerWrapper(sampler, self.data_parallel_rank, self.data_parallel_size)

    # --- launch ---------------------------------------------------------------------
    def check_call(self, call) -> None:
        if self.start_method == "popen" and call.interactive and not call.external and len(call.devices) > 1:
            raise ValueError(f"strategy={self.name!r} re-runs your script in each extra process, but this is a "
                             "notebook or REPL. Use strategy='ddp_notebook' (fork) here, or run the code as a script.")

    def make_launcher(self):
        """The launcher that starts this call's ranks; in a rank that exists already, the handshake of the launcher
        that started it (if easyfit's own) or None."""
        if self.environment.creates_processes_externally:
            from easyfit.distributed.launchers import existing_rank_launcher
            return existing_rank_launcher(self.environment)
        return self.start_launcher()

    def start_launcher(self):
        """The launcher that creates this call's ranks: the script re-run for the other local ranks, or processes
        spawned or forked (`start_method`)."""
        if self.start_method in ("spawn", "fork"):
            from easyfit.distributed.launchers import ProcessLauncher
            return ProcessLauncher(self, self.start_method)
        from easyfit.distributed.launchers import ScriptLauncher
        return ScriptLauncher(self) if self.num_processes > 1 else None

    # --- life -----------------------------------------------------------------------
    #: what a call holds in this process (a backend with more to hold gives its own)
    call_state_type = ParallelCall

    def setup_environment(self, launched: Launched = NOT_LAUNCHED) -> ParallelCall:
        """Select this process's device and join the process group; `launched`: how the call's ranks came to exist
        (a spawn / fork launcher's processes exist for this call alone)."""
        call = self.call_state_type(launched)
        super().setup_environment(launched)
        self.join_process_group(call)
        return call

    def join_process_group(self, call: ParallelCall) -> None:
        """Create torch.distributed's default process group of this call's ranks (or check the one that exists),
        each rank of easyfit's own launch on its share of the CPU cores."""
        if self.root_device.type == "cpu" and call.launched.by_easyfit:   # easyfit's own launch, not torchrun's
            call.cores.apply(self.num_processes)
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
        if not call.launched.for_this_call:   # kept for later calls: destroyed when the script ends
            atexit.register(destroy_process_group)

    def end_fit(self, fit: Fit, user_net: torch.nn.Module, user_optimizer: torch.optim.Optimizer) -> None:
        """Rank 0's buffers into every rank's net (BatchNorm's running statistics, which each rank updated from its
        own batches): the net is the same in every process after the fit, the one rank 0's checkpoints hold."""
        from easyfit.distributed.strategy_parts.buffers import share_rank_zero_buffers
        share_rank_zero_buffers(self, user_net)
        super().end_fit(fit, user_net, user_optimizer)

    def teardown(self, call: ParallelCall) -> None:
        """The call's own process groups end with it, and its share of the cores; in processes started for this call
        alone, the default group too (`leave_process_group`)."""
        call.cores.restore()
        destroy_subgroups(call.subgroups)
        if call.launched.for_this_call:
            self.leave_process_group()

    def leave_process_group(self) -> None:
        """End the default process group, which a re-launched script keeps for later calls."""
        destroy_process_group()

    # --- a net its setup wrapped in DistributedDataParallel (DDP's, ZeRO's) ----------------
    def module_for_eval(self, fit: Fit) -> torch.nn.Module:
        """The wrapped training net (validation in a fit) takes rank 0's buffers first, as DDP gives them to every
        rank at its next forward: the ranks evaluate one net, the one rank 0's checkpoints hold."""
        if isinstance(fit.net, DistributedDataParallel):
            from easyfit.distributed.strategy_parts.buffers import share_rank_zero_buffers
            share_rank_zero_buffers(self, fit.net.module)
        return super().module_for_eval(fit)

    def no_sync(self, fit: Fit) -> contextlib.AbstractContextManager:
        return fit.net.no_sync() if isinstance(fit.net, DistributedDataParallel) else contextlib.nullcontext()

    def uneven_inputs(self, fit: Fit) -> contextlib.AbstractContextManager:
        """torch's join: a rank whose data ran out shadows the gradient all-reduces of the others (which divide by
        the whole world size), and every rank ends the epoch with the same weights."""
        return fit.net.join() if isinstance(fit.net, DistributedDataParallel) else contextlib.nullcontext()

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
