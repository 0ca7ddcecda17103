"""The samplers of in-memory data: every sample once per epoch, in an order that depends on (seed, epoch) only,
and evaluation shares with no sample repeated."""
from __future__ import annotations

from collections.abc import Iterator

import torch
from torch.utils.data import Sampler


class EpochSampler(Sampler):
    """All indices once per epoch; the shuffle order is a function of (seed, epoch) only,
    so a resumed run sees exactly the order an uninterrupted one would."""

    def __init__(self, length: int, shuffle: bool, seed: int = 0):
        self.length, self.shuffle, self.seed, self.epoch = length, shuffle, seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def index_tensor(self) -> torch.Tensor:
        if not self.shuffle:
            return torch.arange(self.length)
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        return torch.randperm(self.length, generator=generator)

    def __iter__(self) -> Iterator[int]:
        return iter(self.index_tensor().tolist())

    def __len__(self) -> int:
        return self.length


class EvalSampler(Sampler):
    """Rank r of W gets indices r, r+W, r+2W, ...: every sample exactly once, no padding."""

    def __init__(self, length: int, rank: int = 0, world_size: int = 1):
        self.length, self.rank, self.world_size = length, rank, world_size

    def index_tensor(self) -> torch.Tensor:
        return torch.arange(self.rank, self.length, self.world_size)

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.rank, self.length, self.world_size))

    def __len__(self) -> int:
        return len(range(self.rank, self.length, self.world_size))


def sampler_indices(sampler: Sampler) -> torch.Tensor:
    """The indices a sampler yields this epoch, as one tensor."""
    index_tensor = getattr(sampler, "index_tensor", None)
    if index_tensor is not None:
        return index_tensor()
    return torch.as_tensor(list(sampler), dtype=torch.long)
