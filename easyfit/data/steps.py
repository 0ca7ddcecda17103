"""steps_per_epoch / validation_steps: a fixed number of batches per epoch from any data, endless streams included."""
from __future__ import annotations

import warnings

from easyfit.data.batches import batch_count
from easyfit.data.source import BatchSource, WrappedBatches


class StepLimitedBatches(WrappedBatches):
    """At most `steps` batches per epoch. One pass over the data continues into the next epoch, and a new pass
    starts when one has been used up, as Keras does: an endless stream never restarts, and an epoch that runs
    out of data part-way ends early with a warning."""

    def __init__(self, batches: BatchSource, steps: int, role: str = "training"):
        super().__init__(batches)
        self.steps, self.role = steps, role
        self.iterator = None
        self.taken = 0   # batches taken from the current pass
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch   # applied to the data when the next pass starts

    def __len__(self) -> int:
        return self.steps

    def coming_epoch(self) -> int:
        """The number of batches the next epoch yields: `steps`, or fewer where the data's known length runs out
        first (the epoch then ends early, and its last accumulation window is a short one)."""
        total = batch_count(self.batches)
        if total is None:
            return self.steps
        return min(self.steps, total - (0 if self.iterator is None else self.taken))

    def __iter__(self):
        total = batch_count(self.batches)
        for done in range(self.steps):
            if self.iterator is None:
                self.batches.set_epoch(self.epoch)
                self.iterator, self.taken = iter(self.batches), 0
            try:
                batch = next(self.iterator)
            except StopIteration:
                self.iterator = None
                warnings.warn(f"the {self.role} data ran out after {done} of this epoch's {self.steps} steps: the "
                              "epoch ends early and the next one starts a new pass over the data. Give data that "
                              "yields at least steps × epochs batches (e.g. an endless generator), or fewer steps.",
                              RuntimeWarning, stacklevel=2)
                return
            self.taken += 1
            yield batch
        if total is not None and self.taken >= total:   # the pass ended with the epoch: the next starts afresh
            self.iterator = None


def limit_steps(batches: BatchSource, steps: int | None, role: str) -> BatchSource:
    """`batches` limited to `steps` per epoch; unchanged when `steps` is None."""
    return batches if steps is None else StepLimitedBatches(batches, steps, role)
