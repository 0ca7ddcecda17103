"""When a checkpointing callback writes (ModelCheckpoint, BackupAndRestore): `save_freq="epoch"` or every N training
batches."""
from __future__ import annotations

from easyfit.utils.checks import check_positive_int


class SaveFrequency:
    """`save_freq`: "epoch", or a number N of training batches, counted across epochs (as Keras counts) from the last
    save. A save that falls due inside a `gradient_accumulation_steps` window waits for the window's end (the epoch's
    last batch ends one too): a checkpoint holds whole windows only, so it always resumes exactly."""

    def __init__(self, save_freq: str | int, owner: str):
        if save_freq != "epoch":
            check_positive_int(save_freq, f"{owner}: save_freq", "'epoch' or a positive number of batches")
        self.save_freq = save_freq
        self.since_save, self.last_batch = 0, -1

    @property
    def per_epoch(self) -> bool:
        return self.save_freq == "epoch"

    def epoch_begin(self, model) -> None:
        """The batches count by index: with steps_per_execution=N the hook sees every N-th batch, and a resumed epoch
        starts after the batches its checkpoint had trained."""
        self.last_batch = getattr(getattr(model, "position", None), "batches_done", 0) - 1

    def due(self, model, batch: int) -> bool:
        """Whether to save after training batch `batch` (counted here: call it once per batch hook)."""
        self.since_save += batch - self.last_batch
        self.last_batch = batch
        position = getattr(model, "position", None)
        if self.per_epoch or self.since_save < self.save_freq or not getattr(position, "whole_windows", True):
            return False
        self.since_save = 0
        return True
