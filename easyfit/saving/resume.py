"""Mid-epoch resume: how far the current epoch had trained when a checkpoint was written, and the batches left."""
from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from easyfit.data.batches import epoch_length
from easyfit.parts import metric_state


class EpochPosition:
    """The batches the current epoch has trained, the RNG state its batches were drawn with, its loss and its
    metrics' state so far.

    A checkpoint written mid-epoch (`ModelCheckpoint(save_freq=N)`, the fault-tolerance checkpoint) stores it; the
    resumed fit draws the epoch's batches again with that RNG state (the shuffle order is a function of (seed,
    epoch)), drops those already trained, and continues with the RNG state of the checkpoint: the weights of an
    uninterrupted run. The epoch's loss (summed over every rank, with its sample count) and each rank's metric state
    are put back too: the resumed epoch logs the loss and metrics of an uninterrupted one."""

    def __init__(self, batches_done: int = 0, rng: torch.Tensor | None = None, loss: tuple[float, int] = (0.0, 0),
                 accumulate: int | None = None):
        self.batches_done, self.rng, self.loss = batches_done, rng, loss
        self.resuming = batches_done > 0
        self.tracker = None   # the epoch's LossTracker, read when a checkpoint is written
        self.inexact_metrics: list[str] = []   # restored metrics that count only the batches after the resume
        self.accumulate = accumulate   # the fit's gradient_accumulation_steps (that of the writer, when loaded)
        self.num_batches: int | None = None   # the epoch's batches, where known

    @property
    def whole_windows(self) -> bool:
        """Whether the batches trained so far end an accumulation window (every gradient is in the weights): a
        checkpoint written now resumes exactly."""
        accumulate = self.accumulate or 1
        return self.batches_done % accumulate == 0 or self.batches_done == self.num_batches

    @classmethod
    def from_state(cls, state: dict | None, strategy=None, metrics=None) -> EpochPosition:
        """The position of a checkpoint, on this rank of `strategy`: global rank 0 carries the loss every rank summed
        before the checkpoint; `metrics` get this rank's state back (see easyfit.parts.metric_state)."""
        if not state:
            return cls()
        rank, world_size = (0, 1) if strategy is None else (strategy.global_rank, strategy.world_size)
        # RNG states are CPU byte tensors, wherever the checkpoint was loaded to (map_location)
        position = cls(state["batches_done"], state["rng"].cpu(), tuple(state["loss"]) if rank == 0 else (0.0, 0),
                       state.get("accumulate"))
        if metrics is not None and state.get("metrics") is None:   # written before checkpoints held them
            metrics.reset()
            position.inexact_metrics = list(metrics.names)
        elif metrics is not None:
            device = torch.device("cpu") if strategy is None else strategy.root_device
            position.inexact_metrics = metric_state.restore(metrics, state["metrics"], rank, world_size, device)
        return position

    def state_dict(self, strategy, metrics) -> dict | None:
        """None at an epoch boundary; else what `from_state` needs to resume at the next batch. With several
        processes every rank calls it (the loss is summed and the metric states gathered: two collectives)."""
        if not self.batches_done:
            return None
        total, count = self.tracker.global_totals(strategy) if strategy.world_size > 1 else self.tracker.totals()
        return {"batches_done": self.batches_done, "rng": self.rng, "loss": (float(total), int(count)),
                "metrics": metric_state.gather(metrics, strategy), "accumulate": self.accumulate}

    def metrics_note(self, epoch: int, word: str) -> str:
        """"; ..." naming the resumed epoch's metrics that count only its batches after the resume (their state could
        not be restored: see easyfit.parts.metric_state); "" when every metric continues exactly."""
        names = self.inexact_metrics
        if not names or not self.resuming:
            return ""
        return (f"; epoch {epoch + 1}'s {', '.join(names)} {'counts' if len(names) == 1 else 'count'} only the "
                f"batches after the {word}")

    def begin(self, batches: Iterable, tracker, accumulate: int, epoch: int) -> tuple[Iterable, int]:
        """(the batches this epoch still trains, the index of the first); a resumed epoch's tracker gets the loss
        of the batches trained before the checkpoint (its metrics got their state when the checkpoint was loaded)."""
        self.tracker, written_with, self.accumulate = tracker, self.accumulate, accumulate
        self.num_batches = epoch_length(batches)
        if not self.resuming:
            self.batches_done, self.rng = 0, torch.get_rng_state()
            return batches, 0
        self.resuming = False
        self._check(batches, written_with, epoch)
        tracker.folded_sum, tracker.folded_count = float(self.loss[0]), self.loss[1]
        return self._skip(batches), self.batches_done

    def end(self) -> None:
        """The epoch is complete: a checkpoint written now resumes at the next epoch."""
        self.batches_done, self.tracker = 0, None

    def _check(self, batches: Iterable, written_with: int | None, epoch: int) -> None:
        where = f"after batch {self.batches_done} of epoch {epoch + 1}"
        if isinstance(getattr(batches, "loader", None), Iterator):
            raise TypeError(f"the checkpoint was written {where}: resuming there means drawing that epoch's batches "
                             "again and skipping those trained, which a one-shot iterator or generator cannot do. "
                             "Pass re-iterable data (a list of batches, a Dataset or a DataLoader), or resume from a "
                             "checkpoint written at the end of an epoch (ModelCheckpoint(save_freq='epoch')).")
        if not self.whole_windows:
            writer = f"the run that wrote it had gradient_accumulation_steps={written_with}: resume with that, or " \
                if written_with else "resume "
            raise ValueError(f"the checkpoint was written {where}, inside a window of gradient_accumulation_steps="
                             f"{self.accumulate} batches whose gradients it does not hold, so the run cannot continue "
                             f"exactly; {writer}from another checkpoint. To start the run over instead, give "
                             "BackupAndRestore a new backup_dir (or leave out resume_from). ModelCheckpoint and "
                             "BackupAndRestore write no checkpoint inside a window.")

    def _skip(self, batches: Iterable) -> Iterator:
        now = torch.get_rng_state()
        torch.set_rng_state(self.rng)
        iterator = iter(batches)
        for _ in zip(range(self.batches_done), iterator):
            pass
        torch.set_rng_state(now)
        return iterator
