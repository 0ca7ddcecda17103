"""How ranks come to exist, and how they are watched so that one failure stops them all.

- `ScriptLauncher` ("ddp"): re-runs the user's script in child processes; this process is rank 0.
- `ProcessLauncher` ("ddp_spawn" / "ddp_fork"): starts fresh processes (spawn) or forks this one, runs the
  function in each, and hands rank 0's result back to the caller.
A launcher has two members: `rank_zero_in_caller` and `launch(function, *args)`, which returns rank 0's result.
"""
from __future__ import annotations

import atexit
import ctypes
import os
import pickle
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from typing import Any, Callable

import torch
from torch.multiprocessing.spawn import ProcessException

from easyfit.checkpoint import load_checkpoint_file, save_checkpoint_file
from easyfit.distributed.environments import LAUNCHED_RANK_VARIABLE
from easyfit.distributed.pickling import check_picklable

EXCHANGE_DIR_VARIABLE = "EASYFIT_EXCHANGE_DIR"
RESULT_FILE = "result.pt"
WATCH_INTERVAL = 0.1
TERMINATE_GRACE_SECONDS = 3.0


class RankFailedError(RuntimeError):
    """A rank raised or died; carries the rank and the original traceback text."""

    def __init__(self, rank: int, details: str):
        self.rank, self.details = rank, details
        super().__init__(f"rank {rank} failed; all ranks were stopped. Its error:\n\n{details}")


# ---------------------------------------------------------------------------------------------
# Script re-launch ("ddp")
# ---------------------------------------------------------------------------------------------
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


def _die_with_parent() -> None:
    """In a child: receive SIGTERM when the parent dies, so no rank outlives its launcher (Linux)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


class ScriptLauncher:
    """Starts local ranks 1..N-1 as copies of the running script, once per program; this process is local rank 0.

    The children live until the script ends, so later fit / evaluate / predict calls reuse them. Until every child
    has reached its first call, this rank waits while watching them, so a child that fails early stops the run at
    once. After that, when a child fails, this rank's next collective fails too (the peer's connections close); the
    error raised then names the failed rank and carries its traceback. A stuck (not dead) peer ends in the process
    group's timeout. Ctrl-C here stops every child, even while this rank waits inside a collective.
    """

    rank_zero_in_caller = True
    _children: dict[int, subprocess.Popen] = {}
    _exchange_dir: str | None = None
    _world: tuple | None = None

    def __init__(self, strategy):
        self.strategy = strategy

    def launch(self, function: Callable, *args, **kwargs) -> Any:
        world = (self.strategy.num_processes, self.strategy.num_nodes, self.strategy.node_rank)
        cls = type(self)
        if cls._world is None:
            self._start_children()
            cls._world = world
            self._wait_until_children_ready()
        elif not cls._children and world[0] > 1:
            raise RuntimeError("the other ranks of this script were stopped after a failure or an interrupt, and "
                               "they cannot be started again mid-script; fix the error and run the script again")
        elif cls._world != world:
            raise RuntimeError(
                f"this script already runs as {cls._world[0]} processes per node × {cls._world[1]} node(s); a "
                "script re-launched for strategy='ddp' keeps its processes until it ends, so every ddp call in it "
                "must use the same devices and num_nodes")
        try:
            return function(*args, **kwargs)
        except BaseException as error:
            failure = self._wait_for_child_failure(error)
            if failure is not None:
                stop_children()
                raise failure from None
            stop_children()
            raise

    def _start_children(self) -> None:
        strategy, environment = self.strategy, self.strategy.environment
        command = script_command()
        base_env = {**os.environ, "MASTER_ADDR": environment.main_address,
                    "MASTER_PORT": str(environment.main_port), "WORLD_SIZE": str(strategy.world_size),
                    "NODE_RANK": str(strategy.node_rank), "LOCAL_WORLD_SIZE": str(strategy.num_processes),
                    LAUNCHED_RANK_VARIABLE: "1"}
        os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = base_env["MASTER_ADDR"], base_env["MASTER_PORT"]
        ScriptLauncher._exchange_dir = base_env[EXCHANGE_DIR_VARIABLE] = tempfile.mkdtemp(prefix="easyfit-ranks-")
        for local_rank in range(1, strategy.num_processes):
            env = {**base_env, "LOCAL_RANK": str(local_rank),
                   "RANK": str(strategy.node_rank * strategy.num_processes + local_rank)}
            ScriptLauncher._children[local_rank] = subprocess.Popen(command, env=env, preexec_fn=_die_with_parent)
        atexit.register(_wait_for_children_at_exit)
        _relay_interrupts_to_children()

    def _wait_until_children_ready(self) -> None:
        """Wait for every child to reach its first call, stopping everything if one fails on the way."""
        deadline = time.monotonic() + self.strategy.timeout.total_seconds()
        while not all(os.path.exists(_exchange_file("ready", rank)) for rank in ScriptLauncher._children):
            failure = root_cause(_child_failures())
            if failure is not None:
                stop_children()
                raise failure
            if time.monotonic() > deadline:
                stop_children()
                raise RuntimeError(f"the other ranks did not reach their first fit / evaluate / predict call within "
                                   f"{self.strategy.timeout}; every process must make the same calls")
            time.sleep(WATCH_INTERVAL)

    @staticmethod
    def _wait_for_child_failure(error: BaseException, seconds: float = 5.0) -> RankFailedError | None:
        """After an error here that a dead peer explains, give the failing child a moment to exit:
        its error is the original one."""
        deadline = time.monotonic() + (seconds if _looks_like_peer_error(f"{type(error).__name__}: {error}") else 0)
        while not _child_failures() and time.monotonic() < deadline:
            time.sleep(WATCH_INTERVAL)
        time.sleep(WATCH_INTERVAL)   # let a second failing rank finish writing its traceback
        return root_cause(_child_failures())


def _looks_like_peer_error(text: str) -> bool:
    """Errors that a collective raises when a peer went away: consequences, not causes."""
    text = text.lower()
    return any(word in text for word in ("connection closed", "connection reset", "connection refused",
                                         "reset by peer", "broken pipe", "gloo", "nccl", "timed out"))


def rank_failure(rank: int, exitcode: int | None, error_file: str | None) -> RankFailedError | None:
    """What went wrong in a finished rank, from its exit code and the traceback it wrote; None if it succeeded."""
    if exitcode in (None, 0):
        return None
    details = ""
    if error_file and os.path.exists(error_file):
        with open(error_file, encoding="utf-8", errors="replace") as file:
            details = file.read().strip()
    if exitcode < 0:
        details = details or f"killed by signal {signal.Signals(-exitcode).name}"
    return RankFailedError(rank, details or f"exited with code {exitcode} (see its output above)")


def root_cause(failures: list[RankFailedError]) -> RankFailedError | None:
    """The failure that caused the others: not a lost peer connection, not the SIGTERM sent to stop a rank."""
    causes = [f for f in failures if not _looks_like_peer_error(f.details) and "SIGTERM" not in f.details]
    return (causes or failures or [None])[0]


def _exchange_file(kind: str, local_rank: int, directory: str | None = None) -> str:
    """Where a child started by ScriptLauncher says it is ready ("ready") or leaves its traceback ("error")."""
    return os.path.join(directory or ScriptLauncher._exchange_dir, f"{kind}-{local_rank}")


def _child_failures() -> list[RankFailedError]:
    failures = (rank_failure(rank, child.poll(), _exchange_file("error", rank))
                for rank, child in ScriptLauncher._children.items())
    return [failure for failure in failures if failure is not None]


def stop_children() -> None:
    """Terminate every child still running (SIGTERM, then SIGKILL after a grace period)."""
    children = list(ScriptLauncher._children.values())
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
    _forget_children()


def _forget_children() -> None:
    if ScriptLauncher._exchange_dir is not None:
        shutil.rmtree(ScriptLauncher._exchange_dir, ignore_errors=True)
    ScriptLauncher._children, ScriptLauncher._exchange_dir = {}, None


def _relay_interrupts_to_children() -> None:
    """Stop the children on Ctrl-C even while the main thread is blocked inside a collective, where Python cannot
    run its signal handler: the signal's byte arrives on a wakeup pipe that a thread watches."""
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
        while ScriptLauncher._children:
            received = os.read(read_end, 64)
            if signal.SIGINT in received:
                stop_children()
                return

    threading.Thread(target=relay, name="easyfit-interrupt-relay", daemon=True).start()


def _wait_for_children_at_exit() -> None:
    """At the end of rank 0's script, wait for the other ranks to finish theirs, and report a failure."""
    for child in ScriptLauncher._children.values():
        try:
            child.wait(timeout=600)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
    failure = root_cause(_child_failures())
    _forget_children()
    if failure is not None:
        print(str(failure), file=sys.stderr, flush=True)
        os._exit(1)


def child_started() -> None:
    """In a child started by ScriptLauncher, at its first call: report uncaught exceptions where the parent reads
    them, and tell the parent this rank is ready to join the process group."""
    directory = os.environ.get(EXCHANGE_DIR_VARIABLE)
    if not directory or getattr(sys.excepthook, "easyfit_reporting", False):
        return
    error_file = _exchange_file("error", int(os.environ["LOCAL_RANK"]), directory)
    previous = sys.excepthook

    def report(exc_type, exc, tb):
        with open(error_file, "w", encoding="utf-8") as file:
            file.write("".join(traceback.format_exception(exc_type, exc, tb)))
        previous(exc_type, exc, tb)

    report.easyfit_reporting = True
    sys.excepthook = report
    open(_exchange_file("ready", int(os.environ["LOCAL_RANK"]), directory), "w").close()


# ---------------------------------------------------------------------------------------------
# Spawn / fork ("ddp_spawn", "ddp_fork", "ddp_notebook")
# ---------------------------------------------------------------------------------------------
class ProcessLauncher:
    """Runs the function in N new processes (spawn or fork); the caller gets rank 0's return value."""

    rank_zero_in_caller = False

    def __init__(self, strategy, start_method: str):
        self.strategy, self.start_method = strategy, start_method

    def launch(self, function: Callable, *args, **kwargs) -> Any:
        if self.start_method == "fork":
            _check_fork_allowed()
        os.environ["MASTER_ADDR"] = self.strategy.environment.main_address
        os.environ["MASTER_PORT"] = str(self.strategy.environment.main_port)
        work = (self.strategy, function, args, kwargs)
        if self.start_method == "spawn":
            # plain pickling gives each rank its own copy: torch's process pickler would put the net's tensors in
            # memory shared by all ranks, and every rank's optimizer step would then land on the same weights
            try:
                work = pickle.dumps(work)
            except Exception:
                check_picklable({"function": function, **{f"args[{i}]": arg for i, arg in enumerate(args)}, **kwargs})
                raise
        with tempfile.TemporaryDirectory(prefix="easyfit-ranks-") as exchange_dir:
            processes = torch.multiprocessing.start_processes(
                _run_rank, args=(work, exchange_dir),
                nprocs=self.strategy.num_processes, join=False, start_method=self.start_method)
            try:
                while not processes.join(timeout=WATCH_INTERVAL, grace_period=TERMINATE_GRACE_SECONDS):
                    pass
            except ProcessException as error:
                failures = [rank_failure(rank, process.exitcode, os.path.join(exchange_dir, str(rank)))
                            for rank, process in enumerate(processes.processes)]
                cause = root_cause([failure for failure in failures if failure is not None])
                raise (cause or RankFailedError(error.error_index, str(error))) from None
            except BaseException:
                _stop_processes(processes.processes)
                raise
            return load_checkpoint_file(os.path.join(exchange_dir, RESULT_FILE))["result"]


def _stop_processes(processes) -> None:
    for process in processes:
        if process.is_alive():
            process.terminate()
    for process in processes:
        process.join(TERMINATE_GRACE_SECONDS)
        if process.is_alive():
            process.kill()


def _run_rank(local_rank: int, work: tuple | bytes, exchange_dir: str) -> None:
    """The body of a spawned / forked rank: run, then rank 0 leaves its result in `exchange_dir`;
    a failing rank leaves its traceback there instead."""
    try:
        strategy, function, args, kwargs = pickle.loads(work) if isinstance(work, bytes) else work
        strategy.set_local_rank(local_rank)
        result = function(*args, **kwargs)
        if local_rank == 0:
            save_checkpoint_file(os.path.join(exchange_dir, RESULT_FILE), {"result": result})
    except BaseException:
        with open(os.path.join(exchange_dir, str(local_rank)), "w", encoding="utf-8") as file:
            file.write(traceback.format_exc())
        raise


def _check_fork_allowed() -> None:
    if sys.platform == "win32":
        raise RuntimeError("strategy='ddp_fork' / 'ddp_notebook' needs fork, which Windows lacks; use 'ddp_spawn'")
    if torch.cuda.is_initialized():
        raise RuntimeError(
            "strategy='ddp_fork' / 'ddp_notebook' cannot fork after CUDA has been initialised in this process "
            "(a forked child cannot use it). Restart the kernel and call fit before anything touches the GPU "
            "(e.g. avoid net.cuda() or torch.cuda calls before fit), or use strategy='ddp_spawn' from a script.")
