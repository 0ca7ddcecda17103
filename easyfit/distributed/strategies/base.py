"""The Strategy contract: everything the training loop may ask of a backend."""
from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch.utils.data import Sampler

from easyfit.checkpoint import load_checkpoint_file, save_checkpoint_file
from easyfit.data import EpochSampler, EvalSampler
from easyfit.optimizers import align_state
from easyfit.precision import Precision

#: the modules `setup` may wrap the user's net in
WRAPPERS = (torch.nn.DataParallel, torch.nn.parallel.DistributedDataParallel)


class Strategy:
    """One process's view of a backend. The base class is a correct single-process backend.

    Subclasses override what their backend does differently: how ranks come to exist
    (`launcher`), how the net is wrapped (`setup`), and the collectives.
    """

    name = "single"
    #: how ranks are started; None means "this process is the only rank, or they already exist"
    launcher = None

    def __init__(self, device: torch.device | str | None = None):
        self.root_device = torch.device(device or "cpu")

    # --- identity -------------------------------------------------------------------
    world_size = 1
    global_rank = 0
    local_rank = 0
    node_rank = 0

    @property
    def is_global_zero(self) -> bool:
        return self.global_rank == 0

    @property
    def batch_factor(self) -> int:
        """Per-process batches that make one global optimizer step."""
        return self.world_size

    def describe_batch_factor(self) -> str:
        """Words for the summary line: what `batch_factor` counts."""
        return "processes" if self.batch_factor != 1 else "process"

    # --- life -----------------------------------------------------------------------
    def setup_environment(self) -> None:
        """Create the process group (if any) and select this process's device."""
        if self.root_device.type == "cuda":
            torch.cuda.set_device(self.root_device)

    def setup(self, net: torch.nn.Module, optimizer: torch.optim.Optimizer):
        """Move the net (and the optimizer's state) to the device and wrap it for the backend.
        Returns (net, optimizer)."""
        net.to(self.root_device)
        align_state(optimizer)
        return net, optimizer

    def unwrap(self, net: torch.nn.Module) -> torch.nn.Module:
        """The user's module inside the DataParallel / DistributedDataParallel wrapper `setup` put around it
        (a user's net that merely has a `module` attribute is returned as it is)."""
        return net.module if isinstance(net, WRAPPERS) else net

    def teardown(self) -> None:
        """Release what `setup_environment` created."""

    # --- data -----------------------------------------------------------------------
    def train_sampler(self, dataset_len: int, shuffle: bool, seed: int) -> Sampler:
        return EpochSampler(dataset_len, shuffle=shuffle, seed=seed)

    def eval_sampler(self, dataset_len: int) -> Sampler:
        """Every sample exactly once across all ranks (no padding), so metrics are exact."""
        return EvalSampler(dataset_len, rank=self.global_rank, world_size=self.world_size)

    def wrap_user_sampler(self, sampler: Sampler) -> Sampler:
        """Give this rank its share of a sampler the user wrote."""
        return sampler

    # --- step -----------------------------------------------------------------------
    def backward(self, loss: torch.Tensor, precision: Precision) -> None:
        precision.backward(loss)

    def optimizer_step(self, optimizer: torch.optim.Optimizer, precision: Precision) -> None:
        precision.optimizer_step(optimizer)

    def no_sync(self, net: torch.nn.Module) -> contextlib.AbstractContextManager:
        """Skip gradient synchronisation for an accumulation micro-step."""
        return contextlib.nullcontext()

    def clip_gradients(self, net: torch.nn.Module, max_norm: float) -> None:
        torch.nn.utils.clip_grad_norm_(net.parameters(), max_norm)

    # --- collectives ----------------------------------------------------------------
    def reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """Reduce over all ranks ("sum", "mean", "max", "min"); identity on one process."""
        return tensor

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """This rank's tensor from every rank, in rank order (shapes may differ between ranks)."""
        return [tensor]

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return obj

    def barrier(self) -> None:
        """Wait for every rank."""

    # --- checkpoints ----------------------------------------------------------------
    def save_checkpoint(self, path: str, state: dict) -> None:
        """Write `state` atomically. Only global rank 0 writes; the others return at once, so calling this on
        rank 0 alone is fine for backends that keep the full state in every process."""
        if self.is_global_zero:
            save_checkpoint_file(path, state)

    def load_checkpoint(self, path: str) -> dict:
        return load_checkpoint_file(path, map_location=self.root_device)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(device={self.root_device}, world_size={self.world_size})"
