"""CSVLogger: one CSV row per epoch with the epoch number and every epoch log value."""
from __future__ import annotations

import csv
import os

from easyfit.callbacks.base import Callback


class CSVLogger(Callback):
    """Write `epoch` (counting from 0, as `History.epoch`) and the epoch logs to `filename`, one flushed row per epoch.

    Columns follow the order the keys first appear. A key that appears later (val_* with `validation_freq` > 1)
    adds a column: the file is rewritten with the wider header and earlier rows leave that cell empty.
    With `append`, rows go after those already in the file (use it when resuming). Only global rank 0 writes.
    A checkpoint holds how many rows the file had: a fit resumed from it with `append` first drops the rows written
    after it (the epochs it trains again), so the file reads as the uninterrupted run's.
    """

    def __init__(self, filename: str | os.PathLike, separator: str = ",", append: bool = False):
        self.filename, self.separator, self.append = os.fspath(filename), separator, append
        self.fields: list[str] = ["epoch"]
        self.written_fields: list[str] | None = None
        self.rows: list[dict] = []
        self.file = None
        self.resumed_rows: int | None = None   # the rows of the file when the checkpoint this fit resumes was written

    def state_dict(self) -> dict:
        return {} if self.file is None else {"rows": len(self.rows)}

    def load_state_dict(self, state: dict) -> None:
        self.resumed_rows = state["rows"]

    def state_key(self) -> str:
        return f"CSVLogger(filename={self.filename!r})"

    def on_train_begin(self, logs=None):
        if not self.model.is_global_zero:
            return
        self.fields, self.written_fields, self.rows = ["epoch"], None, []
        if self.append and os.path.isfile(self.filename) and os.path.getsize(self.filename) > 0:
            with open(self.filename, newline="") as file:
                reader = csv.DictReader(file, delimiter=self.separator)
                self.rows = list(reader)
                self.fields = list(reader.fieldnames or ["epoch"])
                self.written_fields = list(self.fields)
        resumed, self.resumed_rows = self.resumed_rows, None
        self.file = open(self.filename, "a" if self.append else "w", newline="")
        if self.append and resumed is not None and len(self.rows) > resumed:
            self.rows = self.rows[:resumed]
            self._rewrite()

    def on_epoch_end(self, epoch, logs=None):
        if self.file is None:
            return
        row = {"epoch": epoch, **(logs or {})}
        self.rows.append(row)
        self.fields += [key for key in row if key not in self.fields]
        if self.fields == self.written_fields:
            self._writer().writerow(row)
        else:
            self._rewrite()
        self.file.flush()

    def on_train_end(self, logs=None):
        if self.file is not None:
            self.file.close()
            self.file = None

    def _writer(self) -> csv.DictWriter:
        return csv.DictWriter(self.file, self.fields, delimiter=self.separator, restval="")

    def _rewrite(self) -> None:
        """Write the whole file again under the current header."""
        self.file.close()
        self.file = open(self.filename, "w", newline="")
        writer = self._writer()
        writer.writeheader()
        writer.writerows(self.rows)
        self.written_fields = list(self.fields)
