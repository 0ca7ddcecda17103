"""Each epoch's logs reported to Ray: `TuneReport` in a Ray Tune trial (its scheduler, e.g. ASHA, may stop the trial
there), `RayTrainReport` in a Ray Train worker (`launcher="ray"` adds it). Ray is imported only when one reports."""
from __future__ import annotations

import importlib.util
import numbers

from easyfit.callbacks.base import Callback


def epoch_metrics(epoch: int, logs) -> dict:
    """The epoch's logs as numbers, with the epoch counted from 1 (`training_iteration` counts reports)."""
    values = {name: float(value) for name, value in (logs or {}).items()
              if isinstance(value, numbers.Number) or getattr(value, "ndim", None) == 0}
    return {**values, "epoch": epoch + 1}


class TuneReport(Callback):
    """In a Ray Tune trial's function, report every epoch's logs with `ray.tune.report`: Tune's search and its
    scheduler see them, and a scheduler that stops the trial (ASHA, median stopping) ends the fit there.

    Run a single-process fit in each trial (one trial a CPU or GPU); Tune spreads the trials over the cluster.

    Args:
        metrics: the log names to report (default every one, e.g. "loss", "val_loss", "val_accuracy").
    """

    may_stop_training = False

    def __init__(self, metrics: list[str] | None = None):
        if importlib.util.find_spec("ray") is None:
            raise ImportError('TuneReport needs Ray Tune: pip install "easyfit[ray]" (or pip install "ray[tune]")')
        self.metrics = None if metrics is None else list(metrics)

    def on_epoch_end(self, epoch, logs=None):
        from ray import tune
        values = epoch_metrics(epoch, logs)
        if self.metrics is not None:
            missing = [name for name in self.metrics if name not in values]
            if missing:
                raise KeyError(f"TuneReport: no {', '.join(missing)} in the epoch's logs; they have "
                               f"{', '.join(sorted(values))}")
            values = {name: values[name] for name in [*self.metrics, "epoch"]}
        if self.model.is_global_zero:
            tune.report(values)


class RayTrainReport(Callback):
    """In a Ray Train worker, report every epoch's logs with `ray.train.report` on every worker (Ray's `Result`
    and a Tune search over the trainer see them)."""

    may_stop_training = False

    def on_epoch_end(self, epoch, logs=None):
        from ray import train
        train.report(epoch_metrics(epoch, logs))
