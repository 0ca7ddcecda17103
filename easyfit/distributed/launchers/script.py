"""Script re-launch ("ddp"): the user's script is run again for local ranks 1..N-1; this process is rank 0.

Both sides of the launch live here: `ScriptLauncher` in rank 0 starts and watches the copies (`ScriptRanks`),
and `RelaunchedRankLauncher` in each copy performs the ready handshake at its first call and reports its errors
where rank 0 reads them.
"""
from __future__ import annotations

import atexit
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import traceback
from datetime import timedelta
from typing import Any, Callable

from easyfit.distributed.environments import LAUNCHED_RANK_VARIABLE, START_DIRECTORY
from easyfit.distributed.launchers.base import Launcher
from easyfit.distributed.launchers.failures import (
    RankFailedError,
    exchange_directory,
    looks_like_peer_error,
    rank_failure,
    root_cause,
    stuck_ranks,
)
from easyfit.distributed.launchers.lifetime import die_with_parent

EXCHANGE_DIR_VARIABLE = "EASYFIT_EXCHANGE_DIR"
WATCH_INTERVAL = 0.1
READY_POLL_SECONDS = 0.02   # the first call waits for the other ranks' ready files this often
TERMINATE_GRACE_SECONDS = 3.0


def script_command() -> list[str]:
    """The command that re-runs the user's program the way it was started."""
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    if spec is not None and spec.name and spec.name != "__main__":   # python -m package.module
        module = spec.name[:-len(".__main__")] if spec.name.endswith(".__main__") else spec.name
        return [sys.executable, "-m", module, *sys.argv[1:]]
    main_file = getattr(main, "__file__", None)
    if not main_file or not os.path.exists(main_file):
        raise RuntimeError(
            "strategy='ddp' re-runs your script in each extra process, but this session has no script "
            "(a notebook, REPL or `python -c`). Use strategy='ddp_notebook' (fork) here, or 'ddp_spawn', "
            "or move the code into a .py file.")
    return [sys.executable, os.path.abspath(main_file), *sys.argv[1:]]


def exchange_file(directory: str, kind: str, local_rank: int) -> str:
    """Where a re-run rank says it is ready ("ready") or leaves its traceback ("error")."""
    return os.path.join(directory, f"{kind}-{local_rank}")


def host_store(address: str, port: int, world_size: int, timeout: timedelta):
    """The process group's rendezvous store, served from this process (rank 0). It is multi-tenant: the process
    group's own rendezvous later finds and reuses it, and it serves while this object lives."""
    from torch.distributed import TCPStore
    return TCPStore(address, port, world_size, is_master=True, timeout=timeout, wait_for_workers=False,
                    multi_tenant=True)


class ScriptRanks:
    """The running copies of this script (local ranks 1..N-1), started once; they live until the script ends, so
    later calls reuse them."""

    def __init__(self, strategy):
        environment = strategy.environment
        self.world = (strategy.num_processes, strategy.num_nodes, strategy.node_rank)
        self.exchange_dir = exchange_directory("ranks")
        base_env = {**os.environ, "MASTER_ADDR": environment.main_address,
                    "MASTER_PORT": str(environment.main_port), "WORLD_SIZE": str(strategy.world_size),
                    "NODE_RANK": str(strategy.node_rank), "LOCAL_WORLD_SIZE": str(strategy.num_processes),
                    LAUNCHED_RANK_VARIABLE: "1", EXCHANGE_DIR_VARIABLE: self.exchange_dir}
        os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = base_env["MASTER_ADDR"], base_env["MASTER_PORT"]
        command = script_command()
        self.children: dict[int, subprocess.Popen] = {}
        self.ready = False
        for local_rank in range(1, strategy.num_processes):
            env = {**base_env, "LOCAL_RANK": str(local_rank),
                   "RANK": str(strategy.node_rank * strategy.num_processes + local_rank)}
            # started where the script was started (not where it has chdir'ed since), reading no terminal input
            self.children[local_rank] = subprocess.Popen(command, env=env, cwd=START_DIRECTORY,
                                                         stdin=subprocess.DEVNULL, preexec_fn=die_with_parent)
        # hosted before any child can look for it: a rank that finds no store yet retries after a back-off (~0.7 s)
        self.store = host_store(environment.main_address, environment.main_port, strategy.world_size,
                                strategy.timeout) if strategy.node_rank == 0 else None
        atexit.register(self.wait_at_exit)
        self._relay_interrupts()

    @property
    def stopped(self) -> bool:
        return not self.children

    def failures(self) -> list[RankFailedError]:
        found = (rank_failure(rank, child.poll(), exchange_file(self.exchange_dir, "error", rank))
                 for rank, child in self.children.items())
        return [failure for failure in found if failure is not None]

    def wait_until_ready(self, timeout_seconds: float) -> None:
        """Wait for every child to reach its first call, stopping everything if one fails on the way."""
        if self.ready:
            return
        deadline = time.monotonic() + timeout_seconds
        while not all(self._ready(rank) for rank in self.children):
            failure = root_cause(self.failures()) or self._exited_before_call()
            if failure is not None:
                self.stop()
                raise failure
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the other ranks did not reach their first fit / evaluate / predict call within "
                                   f"{timeout_seconds:.0f} s; every process must make the same calls")
            time.sleep(READY_POLL_SECONDS)
        self.ready = True

    def _ready(self, rank: int) -> bool:
        return os.path.exists(exchange_file(self.exchange_dir, "ready", rank))

    def _exited_before_call(self) -> RankFailedError | None:
        """Any exit of a rank before it reaches the call fails the call, an exit with code 0 included."""
        for rank, child in self.children.items():
            if child.poll() is not None and not self._ready(rank):
                return RankFailedError(rank, f"it exited (code {child.returncode}) before reaching the fit / "
                                             "evaluate / predict call that rank 0 made; every rank must make the "
                                             "same calls")
        return None

    def _any_exited(self) -> bool:
        return any(child.poll() is not None for child in self.children.values())

    def _finished_without_call(self) -> RankFailedError | None:
        """A rank whose script ended normally while this rank was in a call: the call was made by some ranks only."""
        for rank, child in self.children.items():
            if child.poll() == 0:
                return RankFailedError(rank, "its script ended without making the call rank 0 was in. A call that "
                                             "only some ranks make (e.g. inside `if model.is_global_zero:`) cannot "
                                             "run on several processes: make it on every rank, or pass "
                                             "strategy='single' for work one rank does alone")
        return None

    def failure_behind(self, error: BaseException, seconds: float = 15.0) -> RankFailedError | None:
        """After an error here that a dead peer explains, give the failing child a moment to exit: its error is
        the original one."""
        text = f"{type(error).__name__}: {error}"
        # after a timeout a failed peer has long exited; the ones still running are stuck
        timed_out = "timed out" in text.lower()
        deadline = time.monotonic() + (seconds if looks_like_peer_error(text) and not timed_out else 0)
        while not self.failures() and not self._any_exited() and time.monotonic() < deadline:
            time.sleep(WATCH_INTERVAL)
        time.sleep(WATCH_INTERVAL)   # let a second failing rank finish writing its traceback
        failure = root_cause(self.failures()) or self._finished_without_call()
        first = self.world[2] * self.world[0]   # this node's first global rank: this process
        running = [first + rank for rank, child in self.children.items() if child.poll() is None]
        if failure is None and timed_out and running:
            failure = stuck_ranks(RankFailedError(first, text), running)
        return failure

    def stop(self) -> None:
        """Terminate every child still running (SIGTERM, then SIGKILL after a grace period)."""
        children = list(self.children.values())
        for child in children:
            if child.poll() is None:
                child.terminate()
        deadline = time.monotonic() + TERMINATE_GRACE_SECONDS
        for child in children:
            try:
                child.wait(timeout=max(deadline - time.monotonic(), 0.01))
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()
        self._forget()

    def wait_at_exit(self) -> None:
        """At the end of rank 0's script, wait for the other ranks to finish theirs, and report a failure."""
        for child in self.children.values():
            try:
                child.wait(timeout=600)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()
        failure = root_cause(self.failures())
        self._forget()
        if failure is not None:
            print(str(failure), file=sys.stderr, flush=True)
            os._exit(1)

    def _forget(self) -> None:
        shutil.rmtree(self.exchange_dir, ignore_errors=True)
        self.children = {}

    def _relay_interrupts(self) -> None:
        """Stop the children on Ctrl-C even while the main thread is blocked inside a collective, where Python
        cannot run its signal handler: the signal's byte arrives on a wakeup pipe that a thread watches."""
        if threading.current_thread() is not threading.main_thread():
            return
        read_end, write_end = os.pipe()
        os.set_blocking(write_end, False)
        previous = signal.set_wakeup_fd(write_end, warn_on_full_buffer=False)
        if previous != -1:   # someone else (an event loop) owns the wakeup fd: leave it to them
            signal.set_wakeup_fd(previous)
            os.close(read_end)
            os.close(write_end)
            return

        def relay() -> None:
            while self.children:
                if signal.SIGINT in os.read(read_end, 64):
                    self.stop()
                    return

        threading.Thread(target=relay, name="easyfit-interrupt-relay", daemon=True).start()


#: this script's re-run ranks, once started: they belong to the program, not to one call
_script_ranks: ScriptRanks | None = None


def forget_stopped_ranks() -> None:
    """After a failed attempt that `max_restarts` retries: the next call starts new ranks."""
    global _script_ranks
    if _script_ranks is not None and _script_ranks.stopped:
        _script_ranks.store = None   # the store it hosted closes
        _script_ranks = None


def running_script_world() -> tuple[int, int, int] | None:
    """(processes per node, nodes, node rank) of this script's re-run ranks while they run, else None."""
    if _script_ranks is None or _script_ranks.stopped:
        return None
    return _script_ranks.world


class ScriptLauncher(Launcher):
    """Rank 0's side: starts the copies at the first call and runs every call here while they run it there.

    Until every child has reached its first call, this rank waits while watching them, so a child that fails early
    stops the run at once. After that, when a child fails, this rank's next collective fails too (the peer's
    connections close); the error raised then names the failed rank and carries its traceback. Ctrl-C here stops
    every child, even while this rank waits inside a collective.
    """

    rank_zero_in_caller = True

    def __init__(self, strategy):
        self.strategy = strategy

    def start(self, function: Callable, *args, **kwargs) -> Any:
        ranks = self._ranks()
        try:
            return function(*args, **kwargs)
        except BaseException as error:
            failure = ranks.failure_behind(error)
            ranks.stop()
            if failure is not None:
                raise failure from None
            raise

    def start_early(self) -> None:
        """Start the copies now: they import and load their data while this rank does; the first call waits for
        them to reach it."""
        self._ranks(wait=False)

    def _ranks(self, wait: bool = True) -> ScriptRanks:
        global _script_ranks
        strategy = self.strategy
        world = (strategy.num_processes, strategy.num_nodes, strategy.node_rank)
        if _script_ranks is None:
            _script_ranks = ScriptRanks(strategy)
        elif _script_ranks.stopped and world[0] > 1:
            raise RuntimeError("the other ranks of this script were stopped after a failure or an interrupt, and "
                               "they cannot be started again mid-script; fix the error and run the script again")
        elif _script_ranks.world != world:
            raise RuntimeError(
                f"this script already runs as {_script_ranks.world[0]} processes per node × "
                f"{_script_ranks.world[1]} node(s); a script re-launched for strategy='ddp' keeps its processes "
                "until it ends, so every ddp call in it must use the same devices and num_nodes")
        if wait:
            _script_ranks.wait_until_ready(strategy.timeout.total_seconds())
        return _script_ranks


def existing_rank_launcher(environment) -> Launcher | None:
    """In a rank that exists already: the handshake of easyfit's launcher if it started this rank, else None (torchrun
    and the like started it)."""
    return RelaunchedRankLauncher() if environment.launched_by_easyfit else None


class RelaunchedRankLauncher(Launcher):
    """A re-run copy's side: at its first call, report uncaught exceptions where rank 0 reads them and tell rank 0
    this rank is ready to join the process group."""

    rank_zero_in_caller = True

    def start(self, function: Callable, *args, **kwargs) -> Any:
        directory, local_rank = os.environ.get(EXCHANGE_DIR_VARIABLE), int(os.environ.get("LOCAL_RANK", 0))
        if directory:
            report_errors_from_start()
            open(exchange_file(directory, "ready", local_rank), "w").close()
        try:
            return function(*args, **kwargs)
        except BaseException as error:   # reported even if the script catches it, or it is a SystemExit
            if directory:
                _write_error(exchange_file(directory, "error", local_rank), error)
            raise


def _write_error(path: str, error: BaseException) -> None:
    if isinstance(error, SystemExit):
        text = f"it called sys.exit({error.code!r}) in the middle of a fit / evaluate / predict call"
    else:
        text = "".join(traceback.format_exception(type(error), error, error.__traceback__))
    with open(path, "w", encoding="utf-8") as file:
        file.write(text)


def report_errors_from_start() -> None:
    """In a re-run copy of the script: an exception that ends the script, even before its first call (say while
    loading data), leaves its traceback where rank 0 reads it."""
    directory = os.environ.get(EXCHANGE_DIR_VARIABLE)
    if not directory or getattr(sys.excepthook, "easyfit_reporting", False):
        return
    error_file = exchange_file(directory, "error", int(os.environ.get("LOCAL_RANK", 0)))
    previous = sys.excepthook

    def report(exc_type, exc, tb):
        if not os.path.exists(error_file):
            with open(error_file, "w", encoding="utf-8") as file:
                file.write("".join(traceback.format_exception(exc_type, exc, tb)))
        previous(exc_type, exc, tb)

    report.easyfit_reporting = True
    sys.excepthook = report
