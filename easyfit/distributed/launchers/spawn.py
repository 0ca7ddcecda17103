"""Spawn / fork ("ddp_spawn", "ddp_fork", "ddp_notebook"): fresh processes run the call; rank 0's result and
state come back to the caller through a file.

"ddp_spawn" starts its ranks from Python's fork server where the platform has one (Linux, macOS): a process started
once per caller, which imports torch and easyfit once (and torchmetrics, where the caller uses it); each rank is a
fork of it, as clean as a spawned interpreter (it never ran the caller's code) without paying those imports again on
every call (on 2 CPU cores: a 2-rank fit of a small net 2.8 s instead of 10.2, an evaluate 0.5 s instead of 7.9, the
first call 8.9 s). A rank takes the caller's environment variables and standard output and error as they are at the
call, not as they were when the server started (`CallerSide`), and starts from the caller's random state.

No rank outlives its caller: a rank ends when its parent (the caller's thread, or the fork server) does, the fork
server when its caller does (Linux: `lifetime`, `fork_server`), and SIGTERM of the caller stops the ranks first."""
from __future__ import annotations

import contextlib
import inspect
import multiprocessing
import os
import pickle
import shutil
import signal
import sys
import traceback
from multiprocessing import forkserver, reduction, util
from typing import Any, Callable

import torch
from torch.multiprocessing.spawn import ProcessException

from easyfit.distributed.launchers import fork_server
from easyfit.distributed.launchers.base import Launcher, variables_set
from easyfit.distributed.launchers.failures import (
    RankFailedError,
    exchange_directory,
    rank_failure,
    root_cause,
    stuck_ranks,
)
from easyfit.distributed.launchers.lifetime import Terminated, cleaned_up_on_sigterm, die_with_parent
from easyfit.distributed.pickling import check_picklable
from easyfit.saving.checkpoint import save_file_atomically
from easyfit.utils.random_state import GlobalRandomState

RESULT_FILE = "result.pt"
#: what the fork server imports before it forks a rank: easyfit with torch, and what ends it with its caller
PRELOADED = ["easyfit", "easyfit.distributed.launchers.fork_server"]
#: imported by the server too where the caller has them, as each rank would import them again: torch._dynamo (every
#: torch optimizer imports it, 1.2 s a process) and torchmetrics (the caller's metric objects reach every rank; 3.5 s)
PRELOADED_IF_CALLER_HAS = ("torch._dynamo", "torchmetrics")
#: the longest path a Unix socket takes (macOS's 104 bytes less the closing NUL; Linux takes 107)
SOCKET_PATH_MAX = 103
#: the file descriptors of standard output and error
OUTPUTS = (1, 2)
WATCH_INTERVAL = 0.1
TERMINATE_GRACE_SECONDS = 3.0
#: how long a rank's clean-up may take after SIGTERM before the rank is killed
RANK_GRACE_SECONDS = 1.0


def positional_names(function: Callable, args: tuple) -> dict[str, Any]:
    """`args` by the names of `function`'s parameters (`plan`, ...), for messages about them."""
    names = list(inspect.signature(function).parameters)
    return {names[index] if index < len(names) else f"args[{index}]": arg for index, arg in enumerate(args)}


class ProcessLauncher(Launcher):
    """Runs the function in N new processes (spawn or fork); the caller gets rank 0's return value."""

    rank_zero_in_caller = False

    def __init__(self, strategy, start_method: str):
        self.strategy, self.start_method = strategy, start_method

    def start(self, function: Callable, *args, **kwargs) -> Any:
        if self.start_method == "fork":
            _check_fork_allowed()
        # every rank starts from the caller's random state, as the caller would go on drawing it
        work = (self.strategy, function, args, kwargs, GlobalRandomState())
        if self.start_method == "spawn":
            # plain pickling gives each rank its own copy: torch's process pickler would put the net's tensors in
            # memory shared by all ranks, and every rank's optimizer step would then land on the same weights
            try:
                work = pickle.dumps(work)
            except Exception:
                check_picklable({"function": function, **positional_names(function, args), **kwargs})
                raise
        exchange_dir = exchange_directory("spawn")
        try:
            with cleaned_up_on_sigterm():   # SIGTERM stops the ranks below, then ends this process
                return self._run(work, exchange_dir)
        finally:
            shutil.rmtree(exchange_dir, ignore_errors=True)

    def _run(self, work: tuple | bytes, exchange_dir: str) -> Any:
        environment = self.strategy.environment
        # the ranks' rendezvous; the caller's own environment (and the processes it starts later) keeps none
        with variables_set({"MASTER_ADDR": environment.main_address, "MASTER_PORT": str(environment.main_port)}):
            start = process_start(self.start_method)
            caller = CallerSide() if start == "forkserver" else None
            if start == "forkserver":
                fork_server.ensure_running()
            # a rank forked by the fork server is the server's child; any other, this thread's
            parent = None if start == "forkserver" else os.getpid()
            processes = torch.multiprocessing.start_processes(
                _run_rank, args=(work, exchange_dir, caller, parent),
                nprocs=self.strategy.num_processes, join=False, start_method=start)
        try:
            while not processes.join(timeout=WATCH_INTERVAL, grace_period=TERMINATE_GRACE_SECONDS):
                pass
        except ProcessException as error:
            # still running when a peer failed (torch stops them with SIGTERM after a grace period)
            alive = [rank for rank, process in enumerate(processes.processes)
                     if process.is_alive() or process.exitcode == -signal.SIGTERM]
            _stop_processes(processes.processes)
            failures = [rank_failure(rank, process.exitcode, os.path.join(exchange_dir, str(rank)))
                        for rank, process in enumerate(processes.processes) if rank not in alive]
            cause = root_cause([failure for failure in failures if failure is not None])
            cause = stuck_ranks(cause, alive) or cause
            raise (cause or RankFailedError(error.error_index, str(error))) from None
        except BaseException:
            _stop_processes(processes.processes)
            raise
        finally:
            _remove_error_files(processes.error_files)
        return read_result(exchange_dir)


def _remove_error_files(paths: list[str]) -> None:
    """torch's start_processes has a failing rank write its traceback to a file in the temporary folder, which it
    reads and leaves there; easyfit reads each rank's own report from the call's folder, and removes torch's."""
    for path in paths:
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)


def _stop_processes(processes) -> None:
    for process in processes:
        if process.is_alive():
            process.terminate()
    for process in processes:
        process.join(TERMINATE_GRACE_SECONDS)
        if process.is_alive():
            process.kill()


def process_start(start_method: str) -> str:
    """multiprocessing's start method for a launcher's: "spawn" as "forkserver" where there is one and its socket
    fits in the temporary directory, the server importing PRELOADED and those of PRELOADED_IF_CALLER_HAS the caller
    has imported before it forks its first rank."""
    if start_method != "spawn" or "forkserver" not in multiprocessing.get_all_start_methods() or \
            not _server_socket_fits():
        return start_method
    # read when the server starts: the first call
    loaded = [name for name in PRELOADED_IF_CALLER_HAS if name in sys.modules]
    multiprocessing.set_forkserver_preload(PRELOADED + loaded)
    return "forkserver"


def _server_socket_fits() -> bool:
    """The fork server listens on a Unix socket in multiprocessing's folder in the temporary directory; under a long
    TMPDIR (a cluster's job folder) that path is longer than a socket's may be, and the server cannot start ("AF_UNIX
    path too long"): the ranks are spawned then, each importing torch itself."""
    socket_path = os.path.join(util.get_temp_dir(), "listener-" + "x" * 8)   # named as multiprocessing names it
    return len(os.fsencode(socket_path)) <= SOCKET_PATH_MAX


class CallerSide:
    """What a rank forked by the fork server takes from the caller at the call: its environment variables and its
    standard output and error (it would have the server's, as they were when the server started). A spawned rank
    starts with the caller's own and needs none of it."""

    def __reduce__(self):
        # runs while the rank's arguments are pickled for it: DupFd hands it a copy of each file descriptor
        return _take_caller_side, (dict(os.environ), *(reduction.DupFd(fd) for fd in OUTPUTS))


def _take_caller_side(variables: dict, *outputs) -> None:
    os.environ.clear()
    os.environ.update(variables)
    for fd, duplicate in zip(OUTPUTS, outputs):
        os.dup2(duplicate.detach(), fd)


def _run_rank(local_rank: int, work: tuple | bytes, exchange_dir: str, caller: None, parent: int | None) -> None:
    """The body of a spawned / forked rank (`caller`, unpickled, has taken the caller's side); it ends when its
    parent (`parent`, or the fork server) ends, and cleans up on SIGTERM (a rank blocked in a collective ends
    RANK_GRACE_SECONDS later)."""
    die_with_parent(parent)
    if parent is None:
        _release_fork_server()

    def run() -> Any:
        strategy, function, args, kwargs, random_state = pickle.loads(work) if isinstance(work, bytes) else work
        random_state.restore()
        strategy.configure_rank(local_rank)
        return function(*args, **kwargs)

    signal.signal(signal.SIGTERM, signal.SIG_DFL)   # a forked rank's copy of the caller's handler
    with cleaned_up_on_sigterm(grace=RANK_GRACE_SECONDS):
        run_and_report(local_rank, exchange_dir, run)


def _release_fork_server() -> None:
    """Close this rank's copy of the fork server's "alive" pipe, which every client holds and the server ends when
    none does: so a server that does not die with its caller (macOS; one started by other code) ends once the caller
    has ended, and this rank with it (die_with_parent)."""
    server = forkserver._forkserver
    if getattr(server, "_forkserver_alive_fd", None) is not None:
        os.close(server._forkserver_alive_fd)
        server._forkserver_alive_fd = None


def run_and_report(rank: int, exchange_dir: str, run: Callable[[], Any]) -> None:
    """Run a rank's work; rank 0 leaves its result in `exchange_dir`, a failing rank its traceback."""
    try:
        result = run()
        if rank == 0:
            save_file_atomically(os.path.join(exchange_dir, RESULT_FILE), {"result": result})
    except Terminated:   # stopped from outside: no error of its own to report
        raise
    except BaseException:
        with open(os.path.join(exchange_dir, str(rank)), "w", encoding="utf-8") as file:
            file.write(traceback.format_exc())
        raise


def read_result(exchange_dir: str) -> Any:
    """Rank 0's result, unpickled: it is any object the call returned, and the file is this run's own, written by its
    rank 0 into the private folder (mkdtemp: the caller's user only) this call made and removes. No path a user gives
    reaches here. On the CPU: a CUDA context in the caller would make its next forked ranks (ddp_notebook) fail."""
    return torch.load(os.path.join(exchange_dir, RESULT_FILE), map_location="cpu", weights_only=False)["result"]


def _check_fork_allowed() -> None:
    if sys.platform == "win32":
        raise RuntimeError("strategy='ddp_fork' / 'ddp_notebook' needs fork, which Windows lacks; use 'ddp_spawn'")
    if torch.cuda.is_initialized():
        raise RuntimeError(
            "strategy='ddp_fork' / 'ddp_notebook' cannot fork after CUDA has been initialised in this process "
            "(a forked child cannot use it). Restart the kernel and call fit before anything touches the GPU "
            "(e.g. avoid net.cuda() or torch.cuda calls before fit), or use strategy='ddp_spawn' from a script.")
