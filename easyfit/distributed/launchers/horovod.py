"""Ranks for strategy="horovod" from a plain `python train.py`: `horovod.run` over Gloo on this machine.

`horovod.run` pickles the function with cloudpickle, starts `devices` processes (`python -m
horovod.runner.run_task`), and returns every rank's result; when one rank fails it stops the others. Each rank
leaves the traceback of an error in an exchange directory, so the caller gets the original error, not only
Horovod's "a process exited with non-zero status".
"""
from __future__ import annotations

import contextlib
import os
import re
import sys
import tempfile
import traceback
from collections.abc import Iterator
from typing import Any, Callable

from easyfit.distributed.launchers.base import Launcher
from easyfit.distributed.launchers.failures import RankFailedError, rank_failure, read_error_file, root_cause

#: what a rank's Horovod raises when another rank failed first: a consequence, not the cause
HOROVOD_SHUT_DOWN = "Horovod has been shut down"
#: what horovod.run says when a rank exits non-zero
HOROVOD_EXIT = re.compile(r"Process name: (\d+)\s+Exit code: (-?\d+)")
INSTALL_HINT = ("strategy='horovod' needs Horovod built for this torch with PyTorch and Gloo support. Run "
                "scripts/install_horovod.sh from the easyfit repository (it builds horovod 0.28.1 once and caches "
                "the wheel); see docs/horovod.md.")


def import_horovod():
    """`horovod.torch`, or an ImportError that says how to install it."""
    try:
        import horovod.torch as hvd
    except ImportError as error:
        raise ImportError(f"{INSTALL_HINT} ({error})") from error
    return hvd


class HorovodLauncher(Launcher):
    """Runs the function in `strategy.num_processes` Horovod ranks; the caller gets rank 0's return value."""

    rank_zero_in_caller = False

    def __init__(self, strategy):
        self.strategy = strategy

    def start(self, function: Callable, *args, **kwargs) -> Any:
        import_horovod()
        import cloudpickle
        import horovod

        size = self.strategy.num_processes
        with tempfile.TemporaryDirectory(prefix="easyfit-ranks-") as exchange_dir:
            task = RankTask(function, args, kwargs, exchange_dir)
            try:
                cloudpickle.dumps(task)
            except Exception as error:
                raise TypeError(f"strategy='horovod' sends the model, data and callbacks to its processes with "
                                f"cloudpickle, which failed: {error}. Keep open files, locks and sockets out of "
                                "them.") from error
            try:
                with _main_not_reimported():
                    results = horovod.run(task, num_proc=size, hosts=f"localhost:{size}", use_gloo=True,
                                          start_timeout=self.strategy.start_timeout, executable=sys.executable,
                                          disable_cache=True, network_interfaces=loopback_interfaces())
            except Exception as error:
                raise job_failure(exchange_dir, error) from None
        return results[0]


class RankTask:
    """The function horovod.run calls in each rank; on an error it leaves the traceback for the caller."""

    def __init__(self, function: Callable, args: tuple, kwargs: dict, exchange_dir: str):
        self.function, self.args, self.kwargs, self.exchange_dir = function, args, kwargs, exchange_dir

    def __call__(self) -> Any:
        try:
            return self.function(*self.args, **self.kwargs)
        except BaseException:
            rank = os.environ.get("HOROVOD_RANK", "0")
            with open(os.path.join(self.exchange_dir, f"error-{rank}"), "w", encoding="utf-8") as file:
                file.write(traceback.format_exc())
            raise


def job_failure(exchange_dir: str, error: Exception) -> Exception:
    """The failure that stopped the job: the first cause among the ranks' tracebacks, else the rank Horovod
    names with its exit code, else Horovod's own error."""
    failures = [RankFailedError(int(name.split("-")[1]), read_error_file(os.path.join(exchange_dir, name)))
                for name in sorted(os.listdir(exchange_dir))]
    cause = root_cause([failure for failure in failures if HOROVOD_SHUT_DOWN not in failure.details] or failures)
    if cause is not None:
        return cause
    exited = HOROVOD_EXIT.search(str(error))
    if exited is None:
        return error
    return rank_failure(int(exited.group(1)), int(exited.group(2)), None) or error


@contextlib.contextmanager
def _main_not_reimported() -> Iterator[None]:
    """horovod.run watches each rank from a helper process started with multiprocessing's "spawn", which would
    re-run the user's script (and its fit call) unless it is guarded by `if __name__ == "__main__":`. The helper needs
    nothing from the script (the function travels pickled by value), so hide the script from spawn meanwhile."""
    main = sys.modules["__main__"]
    saved = {name: main.__dict__[name] for name in ("__file__", "__spec__") if name in main.__dict__}
    main.__dict__.pop("__file__", None)
    main.__spec__ = None
    try:
        yield
    finally:
        main.__dict__.update(saved)
        if "__spec__" not in saved:
            del main.__spec__


def loopback_interfaces() -> list[str] | None:
    """The loopback interface ("lo" on Linux), so horovod.run need not probe the network for a one-machine job."""
    import psutil
    names = [name for name, addresses in psutil.net_if_addrs().items()
             if any(address.address == "127.0.0.1" for address in addresses)]
    return names or None
