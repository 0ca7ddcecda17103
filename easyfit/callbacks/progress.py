"""Progress display on global rank 0: a tqdm bar per epoch (verbose=1 on a terminal) or one line per epoch."""
from __future__ import annotations

import shutil
import sys
import time

from easyfit.callbacks.base import Callback


def format_logs(logs: dict | None) -> str:
    """'loss: 0.1234 - learning_rate: 1.0000e-05': 4 decimals, or 4 significant digits for small values (Keras')."""
    return " - ".join(f"{key}: {value:.4f}" if value == 0 or abs(value) > 1e-3 else f"{key}: {value:.4e}"
                      for key, value in (logs or {}).items() if isinstance(value, float))


def progress_callbacks(verbose: int | str, is_global_zero: bool) -> list[Callback]:
    """The display callback for a verbosity level; none off rank 0 or with verbose=0.

    verbose=1 (and "auto") draws a bar where it can be redrawn in place (a terminal or a notebook) and prints
    one line per epoch elsewhere (output redirected to a file or a pipe), as verbose=2 does."""
    if not verbose or not is_global_zero:
        return []
    return [ProgressBar()] if verbose in (1, "auto") and redraws_in_place() else [EpochSummary()]


def redraws_in_place() -> bool:
    """Whether a bar can redraw itself: stdout and stderr are terminals, or the code runs in a notebook."""
    return in_notebook() or all(getattr(stream, "isatty", lambda: False)() for stream in (sys.stdout, sys.stderr))


def in_notebook() -> bool:
    """Whether a Jupyter kernel runs this code (a bar there is a widget)."""
    if "ipykernel" in sys.modules and "IPython" in sys.modules:   # imported, and a kernel is running this code
        shell = sys.modules["IPython"].get_ipython()
        return shell is not None and "IPKernelApp" in getattr(shell, "config", {})
    return False


#: the rows tqdm assumes when it knows none: given where a terminal reports 0 rows, as a 0x0 pseudo-terminal does
#: (tqdm would read -1 rows there and draw no bar, leaving empty lines where the epoch's values belong)
DEFAULT_ROWS = 20


def terminal_shape() -> tuple[int | None, int]:
    """The columns a bar may take (the terminal's less one: a full line would wrap on some terminals; COLUMNS when
    set; None in a notebook or where no terminal tells) and the terminal's rows (LINES when set)."""
    if in_notebook():
        return None, DEFAULT_ROWS
    columns, rows = shutil.get_terminal_size(fallback=(0, 0))
    return (columns - 1 if columns > 1 else None), (rows if rows > 0 else DEFAULT_ROWS)


class EpochSummary(Callback):
    """One line per epoch (or per evaluate call) with the epoch's time, loss and metrics."""

    may_stop_training = False

    def __init__(self):
        self.started = 0.0

    def _title(self, epoch) -> str:
        return f"Epoch {epoch + 1}/{self.params.get('epochs', '?')}"

    def on_epoch_begin(self, epoch, logs=None):
        self.started = time.monotonic()

    def on_epoch_end(self, epoch, logs=None):
        print(f"{self._title(epoch)} - {time.monotonic() - self.started:.1f}s - {format_logs(logs)}", flush=True)

    def on_test_end(self, logs=None):
        if "epochs" not in self.params:   # fit's validation is part of the epoch line
            print(f"Evaluate - {format_logs(logs)}", flush=True)


class ProgressBar(EpochSummary):
    """A tqdm bar showing the running loss while an epoch trains and every metric when it ends.

    The running loss is read at most every `refresh_seconds`, so the bar adds no per-step sync."""

    def __init__(self, refresh_seconds: float = 0.1):
        super().__init__()
        self.refresh_seconds = refresh_seconds
        self.bar = None
        self.last_refresh = 0.0

    def _open(self, total, description: str) -> None:
        from tqdm.auto import tqdm
        width, rows = terminal_shape()   # read as each bar opens: a resized terminal counts from the next epoch
        self.bar = tqdm(total=total, desc=description, unit="step", leave=True, ncols=width, nrows=rows,
                        dynamic_ncols=width is None)
        self.last_refresh = time.monotonic()

    def _advance(self, logs, done: int | None = None) -> None:
        """One more step, or (`done`) as far as that many steps: fit with steps_per_execution reports every N-th."""
        bar = self.bar
        if bar is None:
            return
        bar.update(1 if done is None else done - bar.n)
        now = time.monotonic()
        if logs is not None and now - self.last_refresh >= self.refresh_seconds:
            self.last_refresh = now
            bar.set_postfix_str(format_logs({key: logs.get(key) for key in logs if key not in ("batch_loss", "size")}),
                                refresh=False)

    def _close(self, logs: dict | None) -> None:
        """The bar's final line with every value at its end, or, when that line would be wider than the terminal,
        the bar alone and the values on lines of their own below it (as Keras prints them): none is ever cut."""
        bar = self.bar
        if bar is None:
            return
        text = format_logs(logs)
        below = _wrapped(text, bar) if text else []
        bar.set_postfix_str("" if below else text, refresh=True)
        bar.close()
        self.bar = None
        for line in below:
            bar.fp.write(line + "\n")
        bar.fp.flush()

    def on_epoch_begin(self, epoch, logs=None):
        self._open(self.params.get("steps_per_epoch"), self._title(epoch))

    #: the bar catches up with the batches a batch hook did not see
    needs_every_batch = False

    def on_train_batch_end(self, batch, logs=None):
        self._advance(logs, batch + 1)

    def on_epoch_end(self, epoch, logs=None):
        self._close(logs)

    def on_test_begin(self, logs=None):
        if "epochs" not in self.params:
            self._open(None, "Evaluate")

    def on_test_batch_end(self, batch, logs=None):
        if "epochs" not in self.params:   # fit's validation batches are not training steps
            self._advance(logs)

    def on_test_end(self, logs=None):
        if "epochs" not in self.params:
            self._close(logs)

    def on_predict_begin(self, logs=None):
        self._open(None, "Predict")

    def on_predict_batch_end(self, batch, logs=None):
        self._advance(None)

    def on_predict_end(self, logs=None):
        self._close(None)

    def on_exception(self, exception):
        """The bar stays on screen as it stood, and the next bar of this process starts on the line below it."""
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def _wrapped(text: str, bar) -> list[str]:
    """`text` ("key: value - key: value ...") in lines that fit the terminal when the bar's line with it at its end
    would not (the bar's own 10 characters allowed for); [] when it fits, or the width is unknown (a notebook)."""
    from tqdm.utils import disp_len
    width = bar.ncols
    if not width or disp_len(bar.format_meter(**{**bar.format_dict, "postfix": text, "ncols": None})) <= width:
        return []
    lines = [""]
    for item in text.split(" - "):
        joined = f"{lines[-1]} - {item}" if lines[-1] else item
        if lines[-1] and disp_len(joined) > width:
            lines.append(item)
        else:
            lines[-1] = joined
    return lines
