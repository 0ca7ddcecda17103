"""An epoch's loss kept as tensors (no `.item()` per step), and the per-batch logs the callbacks read."""
from __future__ import annotations

from collections.abc import Mapping

import torch


class LossTracker:
    """Sample-weighted mean loss of an epoch, kept as tensors so the step never waits on `.item()`; a batch of a
    loss over counted items (easyfit.training.item_windows) adds its items' summed loss and their number instead."""

    FOLD_EVERY = 1024

    def __init__(self, fold_every: int = FOLD_EVERY, metrics=None):
        self.fold_every = fold_every
        self.metrics = metrics   # the epoch's MetricSet, whose running values the batch logs read
        self.losses: list[torch.Tensor] = []
        self.sizes: list[int] = []
        self.folded_sum: torch.Tensor | float = 0.0
        self.folded_count = 0
        self.counted: list[tuple] = []   # (loss, scale, items) of each counted batch not folded yet
        self.folded_items: torch.Tensor | int = 0   # the counted batches' items folded (read when the totals are)

    def add(self, loss: torch.Tensor, size: int) -> None:
        self.losses.append(loss)
        self.sizes.append(size)
        if len(self.losses) >= self.fold_every:
            self._fold()

    def add_counted(self, loss: torch.Tensor, scale, items) -> None:
        """A counted batch: its items' losses summed over `scale` (its window's D, see item_windows), and how many
        items it holds; multiplied out and added up when folded."""
        self.counted.append((loss, scale, items))
        if len(self.counted) >= self.fold_every:
            self._fold()

    @property
    def empty(self) -> bool:
        """No batch added (nor restored by a resume)."""
        return self.folded_count == 0 and not self.losses and not self.counted \
            and not torch.is_tensor(self.folded_items)

    def _fold(self) -> None:
        if self.counted:
            losses, scales, items = zip(*self.counted)
            losses = torch.stack(losses).double()
            self.folded_sum = self.folded_sum + (losses * _values(scales, losses.device)).sum()
            self.folded_items = self.folded_items + _values(items, losses.device).sum()
            self.counted = []
        if self.losses:
            sizes = torch.tensor(self.sizes, dtype=torch.float64, device=self.losses[0].device)
            self.folded_sum = self.folded_sum + (torch.stack(self.losses).double() * sizes).sum()
            self.folded_count += sum(self.sizes)
            self.losses, self.sizes = [], []

    def totals(self) -> tuple[torch.Tensor, int]:
        self._fold()
        count = self.folded_count + round(float(self.folded_items))
        return torch.as_tensor(self.folded_sum, dtype=torch.float64), count

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



def _values(values: tuple, device: torch.device) -> torch.Tensor:
    """Numbers or 0-dim tensors (one kind in an epoch) as one float64 tensor on `device`."""
    if isinstance(values[0], torch.Tensor):
        return torch.stack(values).to(device, torch.float64)
    return torch.tensor(values, dtype=torch.float64, device=device)


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
