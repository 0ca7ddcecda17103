"""`max_restarts`: easyfit's own launcher starts the ranks of a failed call again, as torchrun's agent does.

Each attempt gets the run id and its restart count (the ranks' fault-tolerance checkpoint restores from them, see
easyfit.distributed.fault_tolerance), a fresh port for its process group, and new processes for every rank the launcher
starts; where rank 0 is the caller's process, the caller's objects as they were before the first attempt
(easyfit.distributed.attempt_start).
Each failure's cause is printed; after the last allowed restart the caller gets `RestartsExhaustedError`.
"""
from __future__ import annotations

import os
import sys
import traceback
import uuid
from typing import Any, Callable

from easyfit.distributed.attempt_start import AttemptStart
from easyfit.distributed.environments import GIVEN_PORT, RESTART_COUNT_VARIABLE, find_free_port
from easyfit.distributed.fault_tolerance import RUN_ID_VARIABLE
from easyfit.distributed.launchers.base import Launcher, variables_set
from easyfit.distributed.launchers.failures import RankFailedError


class RestartsExhaustedError(RankFailedError):
    """Every allowed restart was tried and the last attempt failed too."""

    def __init__(self, failure: RankFailedError, restarts: int):
        RuntimeError.__init__(self, f"rank {failure.rank} failed again after {restarts} restart(s) (max_restarts="
                                    f"{restarts}); all ranks were stopped. The last failure:\n\n{failure.details}")
        self.rank, self.details, self.restarts = failure.rank, failure.details, restarts


class RestartingLauncher(Launcher):
    """Wraps a launcher that starts the ranks (script re-run, spawn, fork) and runs every attempt through it."""

    def __init__(self, launcher: Launcher, strategy, max_restarts: int, model=None, callbacks: list = ()):
        self.launcher, self.strategy, self.max_restarts = launcher, strategy, max_restarts
        self.model, self.callbacks = model, callbacks   # the caller's, which rank 0 trains when it is this process
        self.rank_zero_in_caller = launcher.rank_zero_in_caller

    def start(self, function: Callable, *args, **kwargs) -> Any:
        run_id = f"{os.getpid()}-{uuid.uuid4().hex[:12]}"
        # the new ranks of a restart start from the caller's script: so does rank 0, when it runs here
        here = self.rank_zero_in_caller and self.model is not None
        start = AttemptStart(self.model, self.callbacks) if here else None
        with variables_set({RUN_ID_VARIABLE: run_id, RESTART_COUNT_VARIABLE: "0"}):
            for restart in range(self.max_restarts + 1):
                os.environ[RESTART_COUNT_VARIABLE] = str(restart)
                try:
                    return self.launcher.start(function, *args, **kwargs)
                except Exception as error:   # an interrupt (Ctrl-C) is not a failure to restart from
                    failure = as_rank_failure(error)
                    if restart == self.max_restarts:
                        raise RestartsExhaustedError(failure, restart) from None
                    print(f"easyfit: attempt {restart + 1} failed: rank {failure.rank}: {cause(failure)}; "
                          f"restarting every rank (restart {restart + 1} of {self.max_restarts})",
                          file=sys.stderr, flush=True)
                    self._prepare_restart()
                    if start is not None:
                        start.put_back()

    def _prepare_restart(self) -> None:
        """A new attempt: no process group or store left in this process, and a new port unless the user gave one
        (a new store there holds none of the old attempt's keys, such as the dead ranks' addresses)."""
        from easyfit.distributed.launchers.script import forget_stopped_ranks
        from easyfit.distributed.strategies.parallel import destroy_process_group
        destroy_process_group()
        forget_stopped_ranks()
        if GIVEN_PORT is None:
            os.environ["MASTER_PORT"] = str(find_free_port())


def as_rank_failure(error: Exception) -> RankFailedError:
    """A failing rank's error; an error raised in this process (rank 0 of a re-run script) as rank 0's."""
    if isinstance(error, RankFailedError):
        return error
    return RankFailedError(0, "".join(traceback.format_exception(type(error), error, error.__traceback__)).strip())


def cause(failure: RankFailedError) -> str:
    """The last line of a failure's traceback: the exception and its message."""
    lines = [line for line in failure.details.splitlines() if line.strip()]
    return lines[-1].strip() if lines else "no details"


def with_restarts(launcher: Launcher | None, strategy, options, model=None) -> Launcher | None:
    """The launcher of a fit with `options.max_restarts`: restarting when easyfit starts the ranks. `model` and the
    options' callbacks are the caller's, put back as they were before each restart when rank 0 runs here."""
    max_restarts = options.max_restarts
    if max_restarts == 0:
        return launcher
    environment = getattr(strategy, "environment", None)
    if environment is not None and environment.creates_processes_externally and not environment.launched_by_easyfit:
        raise ValueError(f"max_restarts={max_restarts} restarts the ranks easyfit's own launcher starts, but "
                         f"{environment.name} started these: let it restart them (torchrun --max-restarts="
                         f"{max_restarts}, or SLURM's --requeue) and leave max_restarts out; easyfit's "
                         "fault-tolerance checkpoint restores the restarted ranks either way.")
    if getattr(strategy, "num_nodes", 1) > 1 and not environment.creates_processes_externally:
        raise ValueError(f"max_restarts={max_restarts} restarts the ranks of one machine; a run over "
                         f"{strategy.num_nodes} nodes started by hand cannot restart the others: start it with "
                         "torchrun --max-restarts=N (or SLURM with --requeue) on each node.")
    from easyfit.distributed.launchers.script import RelaunchedRankLauncher
    if launcher is None or isinstance(launcher, RelaunchedRankLauncher):
        return launcher
    return RestartingLauncher(launcher, strategy, max_restarts, model, options.callbacks)
