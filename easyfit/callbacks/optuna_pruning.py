"""OptunaPruning: report a monitored value to an Optuna trial after each epoch and end an unpromising fit early.

Needs optuna (pip install easyfit[optuna]); it is imported only when the callback reports or raises."""
from __future__ import annotations

import importlib.util
import os

from easyfit.callbacks.base import Callback
from easyfit.callbacks.monitor import Monitor, skips_validation


class OptunaPruning(Callback):
    """After each epoch, `trial.report(logs[monitor], epoch)`; when `trial.should_prune()` says so, the fit ends
    after that epoch and `fit` raises `optuna.TrialPruned` to its caller (the objective), which marks the trial
    pruned.

    On several processes every rank reports the same value (the logs are over every process); rank 0's pruner
    decides and every rank stops after the same epoch (one collective per epoch). The error is raised where fit
    was called, once it has returned: in the caller of a spawned or forked fit (whose trial gets rank 0's reports),
    and in every rank of a script run on several processes; never inside the ranks, so `max_restarts` does not
    take a pruned trial for a failure.

    Args:
        trial: the `optuna.trial.Trial` the objective was given.
        monitor: the epoch log value to report (default "val_loss"; epochs without validation report nothing).
    """

    may_stop_training = False   # it stops at epoch ends only, where every rank agrees anyway

    def __init__(self, trial, monitor: str = "val_loss"):
        if importlib.util.find_spec("optuna") is None:
            raise ImportError("OptunaPruning needs the optuna package: pip install easyfit[optuna]")
        for method in ("report", "should_prune"):
            if not callable(getattr(trial, method, None)):
                raise TypeError(f"OptunaPruning: trial must be the optuna Trial the objective was given (with "
                                f"report and should_prune), got {type(trial).__name__}")
        self.trial, self.monitor = trial, Monitor(monitor, "min", owner="OptunaPruning")
        self.reports: list[tuple[int, float]] = []   # (epoch, value) this fit reported
        self.reporter = os.getpid()   # the process whose trial took the reports
        self.pruned_at: int | None = None

    def on_train_begin(self, logs=None):
        self.reports, self.pruned_at, self.reporter = [], None, os.getpid()

    def on_epoch_end(self, epoch, logs=None):
        value = self.monitor.read(logs, skips_validation(self.params, epoch))
        if value is None:
            return
        self.trial.report(value, epoch)
        self.reports.append((epoch, value))
        model = self.model
        prune = model.is_global_zero and self.trial.should_prune()
        if model.strategy.any_rank(prune):   # rank 0's pruner decides for every rank
            self.pruned_at = epoch
            model.stop_training = True

    def on_fit_returned(self):
        if self.reporter != os.getpid():   # rank 0 ran in another process: its reports go to the caller's trial
            for epoch, value in self.reports:
                self.trial.report(value, epoch)
            self.reporter = os.getpid()
        if self.pruned_at is not None:
            import optuna
            epoch, value = self.reports[-1]
            raise optuna.TrialPruned(f"trial {getattr(self.trial, 'number', '?')} pruned after epoch {epoch + 1}: "
                                     f"{self.monitor.name}={value:.6g}")
