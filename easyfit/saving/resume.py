"""Mid-epoch resume: how far the current epoch had trained when a checkpoint was written, and the batches left."""
from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch


class EpochPosition:
    """The batches the current epoch has trained, the RNG state its batches were drawn with, and its loss so far.

    A checkpoint written mid-epoch (`ModelCheckpoint(save_freq=N)`) stores it; the resumed fit draws the epoch's
    batches again with that RNG state (the shuffle order is a function of (seed, epoch)), drops those already
    trained, and continues with the RNG state of the checkpoint: the weights of an uninterrupted run."""

    def __init__(self, batches_done: int = 0, rng: torch.Tensor | None = None, loss: tuple[float, int] = (0.0, 0)):
        self.batches_done, self.rng, self.loss = batches_done, rng, loss
        self.resuming = batches_done > 0
        self.tracker = None   # the epoch's LossTracker, read when a checkpoint is written

    @classmethod
    def from_state(cls, state: dict | None) -> EpochPosition:
        if not state:
            return cls()
        # RNG states are CPU byte tensors, wherever the checkpoint was loaded to (map_location)
        return cls(state["batches_done"], state["rng"].cpu(), tuple(state["loss"]))

    def state_dict(self) -> dict | None:
        """None at an epoch boundary; else what `from_state` needs to resume at the next batch."""
        if not self.batches_done:
            return None
        total, count = self.tracker.totals()
        return {"batches_done": self.batches_done, "rng": self.rng, "loss": (float(total), count)}

    def begin(self, batches: Iterable, tracker, accumulate: int, epoch: int) -> tuple[Iterable, int]:
        """(the batches this epoch still trains, the index of the first); a resumed epoch's tracker gets the loss
        of the batches trained before the checkpoint."""
        self.tracker = tracker
        if not self.resuming:
            self.batches_done, self.rng = 0, torch.get_rng_state()
            return batches, 0
        self.resuming = False
        self._check(batches, accumulate, epoch)
        tracker.folded_sum, tracker.folded_count = float(self.loss[0]), self.loss[1]
        return self._skip(batches), self.batches_done

    def end(self) -> None:
        """The epoch is complete: a checkpoint written now resumes at the next epoch."""
        self.batches_done, self.tracker = 0, None

    def _check(self, batches: Iterable, accumulate: int, epoch: int) -> None:
        where = f"after batch {self.batches_done} of epoch {epoch + 1}"
        if isinstance(getattr(batches, "loader", None), Iterator):
            raise TypeError(f"the checkpoint was written {where}: resuming there means drawing that epoch's batches "
                             "again and skipping those trained, which a one-shot iterator or generator cannot do. "
                             "Pass re-iterable data (a list of batches, a Dataset or a DataLoader), or resume from a "
                             "checkpoint written at the end of an epoch (ModelCheckpoint(save_freq='epoch')).")
        num_batches = len(batches) if hasattr(batches, "__len__") else None
        if self.batches_done % accumulate and self.batches_done != num_batches:
            raise ValueError(f"the checkpoint was written {where}, inside a window of gradient_accumulation_steps="
                             f"{accumulate} batches whose gradients it does not hold, so the run cannot continue "
                             "exactly. Write mid-epoch checkpoints every multiple of gradient_accumulation_steps "
                             "batches (ModelCheckpoint(save_freq=...)).")

    def _skip(self, batches: Iterable) -> Iterator:
        now = torch.get_rng_state()
        torch.set_rng_state(self.rng)
        iterator = iter(batches)
        for _ in zip(range(self.batches_done), iterator):
            pass
        torch.set_rng_state(now)
        return iterator
