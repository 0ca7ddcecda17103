"""BackupAndRestore: an interrupted fit, started again with the same call, continues where it stopped."""
from __future__ import annotations

import os

from easyfit.callbacks.base import Callback
from easyfit.callbacks.save_frequency import SaveFrequency

BACKUP_FILE = "backup.pt"


class BackupAndRestore(Callback):
    """Write a full checkpoint to `backup_dir` at the end of every epoch (`save_freq="epoch"`) or every `save_freq`
    training batches (counted across epochs from the last save; a save due inside a gradient_accumulation_steps
    window waits for the window's end); a fit started with a BackupAndRestore whose folder holds one resumes from it
    exactly (weights, optimizer, RNG, callbacks' states, history, and mid-epoch the epoch's position, loss and metric
    states), as `fit(resume_from=...)` does. When the fit ends without an error the backup is deleted
    (`delete_checkpoint`).

    Use a folder of its own for each run. A backup takes precedence over `fit(resume_from=...)`: it is newer.
    """

    runs_last = True   # after the other callbacks, so that the backup holds their state for the epoch
    may_stop_training = False

    def __init__(self, backup_dir: str | os.PathLike, save_freq: str | int = "epoch", delete_checkpoint: bool = True):
        self.frequency = SaveFrequency(save_freq, "BackupAndRestore")
        self.backup_dir, self.save_freq, self.delete_checkpoint = os.fspath(backup_dir), save_freq, delete_checkpoint
        self.path = os.path.join(self.backup_dir, BACKUP_FILE)

    def state_dict(self) -> dict:
        return {} if self.save_freq == "epoch" else {"batches_since_save": self.frequency.since_save}

    def load_state_dict(self, state: dict) -> None:
        self.frequency.since_save = state["batches_since_save"]

    def on_epoch_begin(self, epoch, logs=None):
        self.frequency.epoch_begin(self.model)

    def on_train_batch_end(self, batch, logs=None):
        if self.frequency.due(self.model, batch):
            self.model.save(self.path)

    def on_epoch_end(self, epoch, logs=None):
        if self.save_freq == "epoch":
            self.model.save(self.path)

    def on_train_end(self, logs=None):
        if self.delete_checkpoint and self.model.is_global_zero and os.path.exists(self.path):
            os.remove(self.path)


def backup_to_resume(callbacks) -> str | None:
    """The backup file a BackupAndRestore among `callbacks` left behind, if there is one."""
    for callback in callbacks:
        if isinstance(callback, BackupAndRestore) and os.path.isfile(callback.path):
            return callback.path
    return None
