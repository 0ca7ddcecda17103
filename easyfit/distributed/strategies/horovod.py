"""Horovod: one process per device, gradients averaged by `hvd.DistributedOptimizer`; no torch process group.

Ranks come from `horovodrun` / `mpirun` (the script runs once per process), or, for `devices=N` from a plain
`python train.py`, from `horovod.run` over Gloo (easyfit's HorovodLauncher). Every collective easyfit needs (the
epoch loss, metric states, checkpoints) goes through Horovod's own.
"""
from __future__ import annotations

import contextlib
import sys
from dataclasses import dataclass

import torch

from easyfit.distributed.collectives import HorovodCollectives
from easyfit.distributed.environments import ClusterEnvironment
from easyfit.distributed.launchers.horovod import HorovodLauncher, import_horovod
from easyfit.distributed.strategies.capabilities import Capabilities
from easyfit.distributed.strategies.parallel import ParallelCall, ParallelStrategy, Placement
from easyfit.distributed.strategies.states import NOT_LAUNCHED, Fit, Launched
from easyfit.parts.optimizers import align_state
from easyfit.parts.precision import Precision
from easyfit.saving.checkpoint import load_checkpoint_file


@dataclass(kw_only=True)
class HorovodFit(Fit):
    """A Horovod fit: the user's optimizer (its state shared with the DistributedOptimizer), and whether this step's
    gradients are all-reduced already (clipping waits for them)."""

    user_optimizer: torch.optim.Optimizer
    synchronized: bool = False


class HorovodStrategy(ParallelStrategy):
    """Data parallel training with Horovod. `compression="fp16"` sends gradients as float16. It joins Horovod's job
    instead of a torch process group, and its collectives are Horovod's."""

    name = "horovod"
    capabilities = Capabilities(plain_optimizer_step=False)   # synchronises the gradients first

    def __init__(self, accelerator: str | None = None, parallel_devices: list[torch.device] | None = None,
                 num_nodes: int | None = None, environment: ClusterEnvironment | None = None,
                 compression: str = "none", start_timeout: int = 60):
        if compression not in ("none", "fp16"):
            raise ValueError(f"compression must be 'none' or 'fp16', got {compression!r}")
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices, num_nodes=num_nodes,
                         environment=environment)
        self.compression, self.start_timeout = compression, start_timeout

    # --- placement ------------------------------------------------------------------
    @property
    def placement(self) -> Placement:
        """Horovod's job says, once this process joined it (in the call's `setup_environment`): fixed for the
        process from then on."""
        return self.read_placement()

    def read_placement(self, local_rank: int = 0) -> Placement:
        """Horovod's answers once this process has joined the job; before, the launcher's, or this process's alone."""
        hvd = sys.modules.get("horovod.torch")   # not imported: not joined
        if hvd is not None and hvd.is_initialized():
            return Placement(hvd.size(), hvd.rank(), hvd.local_rank(), hvd.cross_rank())
        environment = self.environment
        if environment.creates_processes_externally:
            return Placement(environment.world_size(), environment.global_rank(), environment.local_rank(), 0)
        return Placement(self.num_nodes * self.num_processes, 0, 0, 0)

    def freeze(self, placement: Placement) -> None:
        """Nothing to keep: Horovod's job gives the ranks once this process joined it (`placement`)."""

    # each rank read from the job's placement as it stands
    world_size, global_rank, local_rank, node_rank = (
        property(lambda self, field=field: getattr(self.placement, field))
        for field in ("world_size", "global_rank", "local_rank", "node_rank"))

    @property
    def root_device(self) -> torch.device:
        if self.accelerator == "cuda":
            return torch.device("cuda", self.local_rank)
        return torch.device(self.accelerator or "cpu")

    def check_call(self, call) -> None:
        if call.num_nodes > 1 and not call.external:
            raise ValueError("strategy='horovod' starts processes on this machine only; for several machines start "
                             "the script with horovodrun on the first one, e.g. horovodrun -np 8 -H host1:4,host2:4 "
                             "python train.py (see docs/horovod.md)")

    def make_launcher(self):
        if self.environment.creates_processes_externally or self.num_nodes * self.num_processes == 1:
            return None
        return HorovodLauncher(self)

    # --- life -----------------------------------------------------------------------
    def setup_environment(self, launched: Launched = NOT_LAUNCHED) -> ParallelCall:
        """Join Horovod's job first: the call's placement is then Horovod's."""
        hvd = import_horovod()
        hvd.init()
        requested = self.num_nodes * self.num_processes
        if not self.environment.creates_processes_externally and hvd.size() != requested:
            raise RuntimeError(f"this Horovod job has {hvd.size()} processes, but this call asks for {requested}; "
                               "every call in a Horovod job must use the same devices and num_nodes")
        return super().setup_environment(launched)

    def join_process_group(self, call: ParallelCall) -> None:
        """No torch process group: whoever started them, the ranks on this machine share its cores."""
        if self.root_device.type == "cpu":
            call.cores.apply(import_horovod().local_size())

    def leave_process_group(self) -> None:
        """Horovod's job lasts as long as the process."""

    @staticmethod
    def backward_passes_per_step(settings) -> int:
        """The gradient accumulation steps of a fit of `settings` (its TrainingSettings, or None): Horovod counts
        the backward passes of one step itself."""
        return 1 if settings is None else settings.gradient_accumulation_steps

    def setup(self, net: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler=None, settings=None,
              call=None) -> HorovodFit:
        """Broadcast rank 0's weights and optimizer state, and wrap the optimizer in `hvd.DistributedOptimizer`,
        which shares the user's parameter groups and state (so LR schedules and scaling act on both)."""
        hvd = import_horovod()
        net.to(self.root_device)
        align_state(optimizer)
        if hvd.broadcast_object(bool(optimizer.state_dict()["state"]), root_rank=0, name="easyfit.has_state"):
            hvd.broadcast_optimizer_state(optimizer, root_rank=0)   # before the weights: it may take a dummy step
        hvd.broadcast_parameters(net.state_dict(), root_rank=0)
        compression = hvd.Compression.fp16 if self.compression == "fp16" else hvd.Compression.none
        wrapped = hvd.DistributedOptimizer(optimizer, named_parameters=net.named_parameters(),
                                           backward_passes_per_step=self.backward_passes_per_step(settings),
                                           compression=compression)
        _share_state(optimizer, wrapped)
        return HorovodFit(strategy=self, net=net, optimizer=wrapped, scheduler=scheduler, call=call,
                          user_optimizer=optimizer)

    def end_fit(self, fit: HorovodFit, user_net, user_optimizer) -> None:
        _share_state(fit.optimizer, user_optimizer)
        super().end_fit(fit, user_net, user_optimizer)

    def load_optimizer_state(self, fit: Fit, state: dict) -> None:
        fit.optimizer.load_state_dict(state)   # replaces the groups and state: share them with the user's again
        if isinstance(fit, HorovodFit):
            _share_state(fit.optimizer, fit.user_optimizer)

    def load_checkpoint(self, fit: Fit, path: str) -> dict:
        """Rank 0 reads the file and sends it to the others, so only rank 0's machine needs it."""
        hvd = import_horovod()
        state = load_checkpoint_file(path, map_location=self.root_device) if self.is_global_zero else None
        return hvd.broadcast_object(state, root_rank=0, name="easyfit.saving.checkpoint")

    # --- step -----------------------------------------------------------------------
    def zero_grad(self, fit: Fit) -> None:
        fit.optimizer.zero_grad()   # Horovod's zero_grad takes no arguments; it sets gradients to None

    def clip_gradients(self, fit: HorovodFit, max_norm: float, precision: Precision) -> None:
        """Clip the averaged gradients: wait for the all-reduce first."""
        _synchronize(fit)
        super().clip_gradients(fit, max_norm, precision)

    def optimizer_step(self, fit: HorovodFit, precision: Precision) -> None:
        """All-reduce (unless clipping already did), then step; a gradient scaler unscales averaged gradients."""
        _synchronize(fit)
        with fit.optimizer.skip_synchronize():
            precision.optimizer_step(fit.optimizer)
        fit.synchronized = False
        fit.user_optimizer._opt_called = True   # an LR scheduler checks that its (the user's) optimizer stepped

    # --- collectives ----------------------------------------------------------------
    @property
    def collectives(self) -> HorovodCollectives:
        return HorovodCollectives(import_horovod(), self.world_size)

    def no_sync(self, fit: Fit) -> contextlib.AbstractContextManager:
        """Horovod counts backward passes itself (`backward_passes_per_step`), so nothing to skip here."""
        return contextlib.nullcontext()

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(accelerator={self.accelerator!r}, processes_per_node={self.num_processes}, "
                f"num_nodes={self.num_nodes}, compression={self.compression!r})")


def _synchronize(fit: HorovodFit) -> None:
    """Wait for the gradients' all-reduce, once per step."""
    if not fit.synchronized:
        fit.optimizer.synchronize()
        fit.synchronized = True


def _share_state(source: torch.optim.Optimizer, target: torch.optim.Optimizer) -> None:
    """Make `target` use `source`'s parameter groups and per-parameter state (the same objects)."""
    target.param_groups, target.state = source.param_groups, source.state
