"""The protocol of a batch source: what the loop reads of the batches easyfit.data.batches makes of the user's data,
and of each wrapper around them (step limits, sample weights, loss="model")."""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from typing import Any


class BatchSource(ABC):
    """One epoch's batches, on the device, per `iter()`; `len()` is the number of batches in an epoch (a TypeError
    where the data does not know it, see `batch_count`); `set_epoch` seeds the epoch's shuffling.

    sharded: in evaluation, each rank holds a strided share of the samples, so the ranks' outputs are interleaved.
    weighted: the samples carry weights (sample_weight / class_weight): the last tensor of in-memory batches, which
    `WeightedBatches` hands to the loss."""

    def __init__(self, sharded: bool = False, weighted: bool = False):
        self.sharded, self.weighted = sharded, weighted

    @abstractmethod
    def set_epoch(self, epoch: int) -> None: ...

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def __iter__(self) -> Iterator[Any]: ...


class WrappedBatches(BatchSource):
    """The batches of another source (`batches`), changed on the way: its epochs, its length, its `sharded`."""

    def __init__(self, batches: BatchSource, weighted: bool = False):
        super().__init__(batches.sharded, weighted)
        self.batches = batches

    def set_epoch(self, epoch: int) -> None:
        self.batches.set_epoch(epoch)

    def __len__(self) -> int:
        return len(self.batches)
