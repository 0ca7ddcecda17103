"""An epoch's loss kept as tensors (no `.item()` per step), and the per-batch logs the callbacks read."""
from __future__ import annotations

from collections.abc import Mapping

import torch


class LossTracker:
    """Sample-weighted mean loss of an epoch, kept as tensors so the step never waits on `.item()`."""

    FOLD_EVERY = 1024

    def __init__(self, fold_every: int = FOLD_EVERY, metrics=None):
        self.fold_every = fold_every
        self.metrics = metrics   # the epoch's MetricSet, whose running values the batch logs read
        self.losses: list[torch.Tensor] = []
        self.sizes: list[int] = []
        self.folded_sum: torch.Tensor | float = 0.0
        self.folded_count = 0

    def add(self, loss: torch.Tensor, size: int) -> None:
        self.losses.append(loss)
        self.sizes.append(size)
        if len(self.losses) >= self.fold_every:
            self._fold()

    def _fold(self) -> None:
        if self.losses:
            sizes = torch.tensor(self.sizes, dtype=torch.float64, device=self.losses[0].device)
            self.folded_sum = self.folded_sum + (torch.stack(self.losses).double() * sizes).sum()
            self.folded_count += sum(self.sizes)
            self.losses, self.sizes = [], []

    def totals(self) -> tuple[torch.Tensor, int]:
        self._fold()
        return torch.as_tensor(self.folded_sum, dtype=torch.float64), self.folded_count

    def local_mean(self) -> float:
        total, count = self.totals()
        return float(total) / max(count, 1)

    def global_totals(self, strategy) -> tuple[float, int]:
        """(loss sum, sample count) over every process: one collective on `strategy.root_device`, whatever device
        the losses were computed on, and one read back to the host for both numbers."""
        total, count = self.totals()
        device = strategy.root_device
        count = torch.tensor(float(count), dtype=torch.float64, device=device)
        summed, seen = strategy.reduce(torch.stack([total.to(device), count]), "sum").tolist()
        return summed, int(seen)

    def global_mean(self, strategy) -> float:
        """The mean over every sample seen by every process."""
        summed, seen = self.global_totals(strategy)
        if not seen:
            raise ValueError("the data yielded no batches (0 samples); pass at least one sample")
        return summed / seen



class BatchLogs(Mapping):
    """Per-batch logs for callbacks: {"loss", "batch_loss", "size"} and the running value of each metric over the
    epoch's batches so far on this process (as Keras' batch logs), each computed only when read."""

    FIXED = ("loss", "batch_loss", "size")

    def __init__(self, tracker: LossTracker, loss: torch.Tensor, size: int):
        self.tracker, self.loss, self.size = tracker, loss, size

    def __getitem__(self, key):
        if key == "batch_loss":
            return float(self.loss)
        if key == "size":
            return self.size
        if key == "loss":
            return self.tracker.local_mean()
        value = None if self.tracker.metrics is None else self.tracker.metrics.running(key)
        if value is None:
            raise KeyError(key)
        return value

    def __iter__(self):
        metrics = self.tracker.metrics
        return iter((*self.FIXED, *(metrics.running_names() if metrics else ())))

    def __len__(self) -> int:
        return len(self.FIXED) + len(self.tracker.metrics.running_names() if self.tracker.metrics else ())
