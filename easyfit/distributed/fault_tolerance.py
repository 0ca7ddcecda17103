"""Fault tolerance: under a launcher that restarts failed ranks, a fit keeps a checkpoint of its own, and a restarted
rank continues from it before its first step, with no user code.

Who restarts the ranks, and what says this process belongs to a restarted run:
- torchrun with `--max-restarts` > 0: TORCHELASTIC_RUN_ID, TORCHELASTIC_RESTART_COUNT, TORCHELASTIC_MAX_RESTARTS;
- easyfit's own launcher, `fit(..., max_restarts=N)`: the run id and attempt it passes to its ranks;
- SLURM, a job that can be requeued: SLURM_JOB_ID (kept by a requeued job) and SLURM_RESTART_COUNT.
The checkpoint (the run id in its name) is written through the strategy's `save_checkpoint` at the start of the fit,
at every epoch end and every `fault_tolerance_every_n_steps` optimizer steps, atomically; it is deleted when the fit
ends well. Rank 0's view of the run is shared with every rank, so all ranks restore the same checkpoint.
"""
from __future__ import annotations

import itertools
import os
import re
import shutil
import sys
from dataclasses import dataclass

from easyfit.callbacks.base import Callback
from easyfit.distributed import slurm_requeue
from easyfit.distributed.environments import RESTART_COUNT_VARIABLE, START_DIRECTORY
from easyfit.parts.lr_scaling import describe_lrs

RUN_ID_VARIABLE = "EASYFIT_RUN_ID"
DEFAULT_FOLDER = ".easyfit-fault-tolerance"
WORLD_KEY = "fault_tolerance_world"   # the checkpoint's record of the world that wrote it
#: torchrun's run id when none is given: shared by unrelated jobs, so only a restart restores its checkpoint
DEFAULT_TORCHRUN_RUN_ID = "none"

_fit_calls = itertools.count(1)   # fits in this process: a script's second fit keeps a checkpoint of its own
#: what `easyfit.launch(max_restarts=...)` set for the fits of the script that give none
_default_max_restarts = 0


def set_default_max_restarts(max_restarts: int) -> None:
    global _default_max_restarts
    _default_max_restarts = max_restarts


def max_restarts_for(option: int | None) -> int:
    """A fit's `max_restarts`, or the script's default from `easyfit.launch`."""
    return _default_max_restarts if option is None else option


@dataclass(frozen=True)
class RestartableFit:
    """The restartable run this fit belongs to, as rank 0 sees it (shared with every rank)."""
    launcher: str   # "torchrun", "easyfit" or "SLURM"
    path: str       # the fault-tolerance checkpoint of this fit
    restart: int    # which restart this is (0: the first attempt)
    resume_from: str | None   # the checkpoint to restore (None: none of this run exists yet)

    @property
    def restart_word(self) -> str:
        return "requeue" if self.launcher == "SLURM" else "restart"


def elastic_run(restarts_by_easyfit: int, ask_slurm: bool) -> tuple[str, str, int] | None:
    """(launcher, run id, restart count) when a launcher restarts this fit's ranks after a failure, else None.
    `restarts_by_easyfit`: the fit's own `max_restarts` when easyfit's launcher started its ranks, else 0;
    `ask_slurm`: whether to ask SLURM if the job may be requeued (a command; rank 0 asks for all)."""
    env = os.environ
    if "TORCHELASTIC_RUN_ID" in env and int(env.get("TORCHELASTIC_MAX_RESTARTS", "0")) > 0:
        return "torchrun", env["TORCHELASTIC_RUN_ID"], int(env.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if restarts_by_easyfit > 0:
        return "easyfit", env.get(RUN_ID_VARIABLE, "local"), int(env.get(RESTART_COUNT_VARIABLE, "0"))
    if ask_slurm and slurm_requeue.requeueable():
        return "SLURM", env["SLURM_JOB_ID"], int(env.get("SLURM_RESTART_COUNT", "0"))
    return None


def restartable_fit(option, restarts_by_easyfit: int, strategy) -> RestartableFit | None:
    """This fit's run (the same on every rank: rank 0 decides), or None when no launcher restarts it or
    `fault_tolerance=False`."""
    if option is False or strategy.world_size != launched_world_size(strategy):
        return None   # off, or a rank-local fit among the launcher's ranks (strategy="single"): not the run restarted
    if elastic_run(restarts_by_easyfit, ask_slurm=False) is None and "SLURM_JOB_ID" not in os.environ:
        return None   # the same on every rank, from the environment alone
    run = _rank_zero_run(option, restarts_by_easyfit) if strategy.is_global_zero else None
    return strategy.broadcast(run) if strategy.world_size > 1 else run


def _rank_zero_run(option, restarts_by_easyfit: int) -> RestartableFit | None:
    found = elastic_run(restarts_by_easyfit, ask_slurm=True)
    if found is None:
        return None
    launcher, run_id, restart = found
    folder = os.path.join(START_DIRECTORY, DEFAULT_FOLDER) if option in (None, True) else os.fspath(option)
    # easyfit's run id is new for every call; a launcher's lasts for the whole script
    name = run_id if launcher == "easyfit" else f"{run_id}-fit{next(_fit_calls)}"
    path = os.path.abspath(os.path.join(folder, re.sub(r"[^\w.-]", "_", name)))
    restartable = restart > 0 or not (launcher == "torchrun" and run_id == DEFAULT_TORCHRUN_RUN_ID)
    existing = [name for name in (path, f"{path}.old") if os.path.exists(name)]   # .old: see `replace`
    return RestartableFit(launcher, path, restart, existing[0] if restartable and existing else None)


def launched_world_size(strategy) -> int:
    """The number of processes the launcher started (torchrun's WORLD_SIZE), or the strategy's own."""
    if "TORCHELASTIC_RUN_ID" in os.environ:
        return int(os.environ.get("WORLD_SIZE", strategy.world_size))
    return strategy.world_size


class FaultToleranceCheckpoint(Callback):
    """Writes the run's checkpoint at every epoch end and every `every_n_steps` optimizer steps; deletes it when
    the fit ends well. Under SLURM it also saves and requeues the job on the signal before the time limit."""

    runs_last = True   # after the other callbacks: the checkpoint holds their state
    may_stop_training = False

    def __init__(self, run: RestartableFit, every_n_steps: int | None, accumulate: int):
        self.run = run
        self.every = every_n_steps * accumulate if every_n_steps else None
        self.requeue = slurm_requeue.RequeueSignal() if run.launcher == "SLURM" else None

    def on_train_begin(self, logs=None):
        if self.requeue is not None:
            self.requeue.install()

    def on_train_batch_end(self, batch, logs=None):
        saved = bool(self.every) and (batch + 1) % self.every == 0
        if saved:
            self.save()
        self._requeue_if_signalled(saved)

    def on_epoch_end(self, epoch, logs=None):
        self.save()
        self._requeue_if_signalled(saved=True)

    def on_train_end(self, logs=None):
        if self.requeue is not None:
            self.requeue.uninstall()
        if self.model.is_global_zero:
            remove(self.run.path)
            folder = os.path.dirname(self.run.path)
            if os.path.basename(folder) == DEFAULT_FOLDER and not os.listdir(folder):   # leave no empty folder
                os.rmdir(folder)

    def save(self) -> None:
        save(self.model, self.run.path)

    def _requeue_if_signalled(self, saved: bool) -> None:
        if self.requeue is not None and self.requeue.agreed(self.model.strategy):
            if not saved:
                self.save()
            self.requeue.requeue_job(self.model)


def save(model, path: str) -> None:
    """Write the model's full training state to `path` through its strategy (every rank calls it), atomically:
    the strategy writes a new file or folder beside it, which then takes its place."""
    strategy = model.strategy
    state = {**model.checkpoint_state(), WORLD_KEY: {"world_size": strategy.world_size,
                                                     "batch_factor": strategy.batch_factor}}
    partial = f"{path}.partial"
    model._training.save_checkpoint(partial, state)
    if strategy.is_global_zero:
        replace(partial, path)


def replace(new: str, path: str) -> None:
    """Move `new` over `path`. A folder (a sharded checkpoint) cannot be renamed over another: the old one is moved
    aside first and removed after, and `restartable_fit` finds it in between."""
    if os.path.isdir(new) and os.path.exists(path):
        os.replace(path, f"{path}.old")
        os.replace(new, path)
        remove(f"{path}.old")
    else:
        os.replace(new, path)


def remove(path: str) -> None:
    for name in (path, f"{path}.partial", f"{path}.old"):
        if os.path.isdir(name):
            shutil.rmtree(name, ignore_errors=True)
        elif os.path.exists(name):
            os.remove(name)


def begin(model, run: RestartableFit, state: dict | None, options, params: dict, initial_epoch: int) -> None:
    """At the start of a fit with fault tolerance, after any restore: a restored run adds how it resumed to the
    summary line (said on stderr too in a silent fit); a new one writes its first checkpoint, so that a restart
    before the first epoch ends starts again from here."""
    if run.resume_from:
        params["summary"] += "; " + resume_note(model, run, state, options.batch_size,
                                                options.gradient_accumulation_steps, params["lr_multiplier"])
        if not options.verbose and model.is_global_zero:
            print(f"easyfit: {params['summary']}", file=sys.stderr, flush=True)
    else:
        model.completed_epochs = initial_epoch
        save(model, run.path)


def resume_note(model, run: RestartableFit, state: dict, batch_size: int, accumulate: int, multiplier: float) -> str:
    """After the checkpoint was restored: continue the interrupted epoch on this world, and say so. On another
    number of processes the epoch's position is carried over by samples (the global order of the samples does not
    depend on the world size), and each optimizer step scales the schedule's LRs for the new effective batch."""
    strategy, position = model.strategy, model.position
    after = f"after {run.restart_word} {run.restart}" if run.restart else "the run's checkpoint"
    note = f"resumed {after} from epoch {model.completed_epochs + 1}, step {position.batches_done}"
    saved = state.get(WORLD_KEY, {})
    old_factor, new_factor = saved.get("batch_factor", strategy.batch_factor), strategy.batch_factor
    if old_factor == new_factor:
        return note + position.metrics_note(model.completed_epochs, run.restart_word)
    samples = position.batches_done * batch_size * old_factor
    window = batch_size * new_factor * accumulate
    position.batches_done = samples // window * accumulate
    position.resuming = position.batches_done > 0
    redone = samples - position.batches_done * batch_size * new_factor
    again = f", {redone} of its samples trained again" if redone else ""
    where = f" (the epoch continues at step {position.batches_done}{again})" if samples else ""
    lrs = [group["lr"] for group in model.optimizer.param_groups]   # the schedule's own: each step scales them
    old = state.get("lr_multiplier", 1.0)
    return (f"{note}; world size {saved['world_size']} → {strategy.world_size}: the data re-sharded over "
            f"{strategy.world_size} process{'es' if strategy.world_size != 1 else ''}{where}, "
            f"lr {describe_lrs([lr * old for lr in lrs])} → {describe_lrs([lr * multiplier for lr in lrs])}"
            f"{position.metrics_note(model.completed_epochs, run.restart_word)}")
