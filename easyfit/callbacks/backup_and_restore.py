"""BackupAndRestore: an interrupted fit, started again with the same call, continues where it stopped."""
from __future__ import annotations

import os

from easyfit.callbacks.base import Callback

BACKUP_FILE = "backup.pt"


class BackupAndRestore(Callback):
    """Write a full checkpoint to `backup_dir` at the end of every epoch; a fit started with a BackupAndRestore
    whose folder holds one resumes from it exactly (weights, optimizer, RNG, callbacks' states, history), as
    `fit(resume_from=...)` does. When the fit ends without an error the backup is deleted (`delete_checkpoint`).

    Use a folder of its own for each run. A backup takes precedence over `fit(resume_from=...)`: it is newer.
    """

    runs_last = True   # after the other callbacks, so that the backup holds their state for the epoch

    def __init__(self, backup_dir: str | os.PathLike, save_freq: str = "epoch", delete_checkpoint: bool = True):
        if save_freq != "epoch":
            raise ValueError(f"BackupAndRestore: save_freq must be 'epoch' (a backup is written after each "
                             f"epoch), got {save_freq!r}")
        self.backup_dir, self.delete_checkpoint = os.fspath(backup_dir), delete_checkpoint
        self.path = os.path.join(self.backup_dir, BACKUP_FILE)

    def on_epoch_end(self, epoch, logs=None):
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
