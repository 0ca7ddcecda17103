"""torch_xla's launch ("xla" on several devices): one process per device of this host, started by
`torch_xla.launch`; rank 0's result and state come back to the caller through a file, as with spawn."""
from __future__ import annotations

import os
import pickle
import shutil
from typing import Any, Callable

from easyfit.distributed.launchers.base import Launcher
from easyfit.distributed.launchers.failures import exchange_directory, rank_failure, root_cause
from easyfit.distributed.launchers.spawn import read_result, run_and_report


class XLALauncher(Launcher):
    """Runs the function in every replica torch_xla starts; the caller gets rank 0's return value. torch_xla stops
    the others when one raises; the error that caused it is raised here, with its traceback."""

    rank_zero_in_caller = False

    def __init__(self, strategy):
        self.strategy = strategy

    def start(self, function: Callable, *args, **kwargs) -> Any:
        import torch_xla
        # each replica gets its own copy; the strategy among the arguments is the one it configures as its rank
        work = pickle.dumps((self.strategy, function, args, kwargs))
        exchange_dir = exchange_directory("xla")
        try:
            try:
                torch_xla.launch(_run_replica, args=(work, exchange_dir))
            except Exception:
                failures = [rank_failure(int(name), 1, os.path.join(exchange_dir, name))
                            for name in sorted(os.listdir(exchange_dir)) if name.isdigit()]
                cause = root_cause([failure for failure in failures if failure is not None])
                if cause is None:
                    raise
                raise cause from None
            return read_result(exchange_dir)
        finally:
            shutil.rmtree(exchange_dir, ignore_errors=True)


def _run_replica(index: int, work: bytes, exchange_dir: str) -> None:
    """The body of a replica (`index` is its global ordinal)."""
    def run() -> Any:
        strategy, function, args, kwargs = pickle.loads(work)
        strategy.configure_rank(index)
        return function(*args, **kwargs)

    run_and_report(index, exchange_dir, run)
