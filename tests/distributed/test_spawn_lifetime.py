"""The ranks of ddp_spawn / ddp_fork / ddp_notebook end with a caller that is killed (SIGTERM, as a job scheduler
ends a job, or SIGKILL): every rank, ddp_spawn's fork server and multiprocessing's resource tracker are gone within
3 s, ranks blocked in a collective included, and a rank's checkpoint being written is left whole. And the ranks start
from the caller's random state: a seeded script trains the same weights bit for bit, Dropout included.

One caller per (strategy, signal), killed once its ranks train (scripts/spawn_lifetime.py); the SIGKILL callers of
ddp_spawn and ddp_fork first run the seeded fits (ddp_notebook is ddp_fork by another name)."""
from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from runner import SCRIPTS

from easyfit.distributed.launchers.lifetime import Terminated, cleaned_up_on_sigterm
from easyfit.saving.checkpoint import load_data

pytestmark = [pytest.mark.timeout(300),
              pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")]

STRATEGIES = ("ddp_spawn", "ddp_fork", "ddp_notebook")
#: one per start method: the fork server, fork
SEEDED = ("ddp_spawn", "ddp_fork")
SEEDED_RUNS = {(strategy, signal.SIGKILL) for strategy in SEEDED}
ENDED_WITHIN_SECONDS = 3.0
START_TIMEOUT_SECONDS = 200


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def _children(pid: int) -> set[int]:
    """The live processes whose parent is `pid` (a fork server, the resource tracker, forked ranks)."""
    found = set()
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                found.add(int(entry.name))
        except (OSError, IndexError):
            continue
    return found


def _ranks_started(out: Path, caller: subprocess.Popen) -> list[dict]:
    """What the three ranks wrote when their training began (waits for their files)."""
    deadline = time.monotonic() + START_TIMEOUT_SECONDS
    while len(files := sorted(out.glob("rank-*.json"))) < 3:
        if caller.poll() is not None:
            pytest.fail(f"the caller ended ({caller.returncode}) before its ranks started:\n"
                        f"{(out / 'stderr.txt').read_text()[-3000:]}")
        assert time.monotonic() < deadline, "the ranks did not start"
        time.sleep(0.05)
    return [json.loads(file.read_text()) for file in files]


def kill_caller(out: Path, strategy: str, signal_number: int) -> dict:
    """Start the caller, wait for its ranks to train, send it the signal; which of its processes (itself, the ranks,
    their parents, its children) were still there ENDED_WITHIN_SECONDS later, and when each other one had gone."""
    with open(out / "stderr.txt", "w") as errors:
        caller = subprocess.Popen([sys.executable, str(SCRIPTS / "spawn_lifetime.py"), str(out), strategy,
                                   *(["seeded"] if (strategy, signal_number) in SEEDED_RUNS else [])],
                                  env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=errors, stderr=errors)
    watched: dict[int, str] = {}
    try:
        ranks = _ranks_started(out, caller)
        watched = {**{pid: "child of the caller" for pid in _children(caller.pid)},
                   **{rank["parent"]: "parent of a rank" for rank in ranks},
                   **{rank["pid"]: "rank" for rank in ranks}, caller.pid: "caller"}
        os.kill(caller.pid, signal_number)
        start, gone = time.monotonic(), {}
        while len(gone) < len(watched) and time.monotonic() < start + ENDED_WITHIN_SECONDS:
            gone.update({pid: round(time.monotonic() - start, 2) for pid in watched if pid not in gone
                         and not _alive(pid)})
            time.sleep(0.02)
        left = {pid: role for pid, role in watched.items() if pid not in gone}
        return {"left": left, "gone": {watched[pid] + f" {pid}": at for pid, at in gone.items()},
                "returncode": None if left else caller.wait()}
    finally:
        for pid in watched:
            if pid != caller.pid and _alive(pid):
                os.kill(pid, signal.SIGKILL)
        caller.kill()
        caller.wait(timeout=30)


@pytest.fixture(scope="module")
def killed(tmp_path_factory):
    """kill_caller once per (strategy, signal), in a folder in memory where there is one: a disk busy with other
    work can hold a rank's fsync longer than its clean-up may take."""
    outcomes = {}
    memory = Path("/dev/shm")
    root = Path(tempfile.mkdtemp(dir=memory)) if memory.is_dir() else tmp_path_factory.mktemp("killed")

    def run(strategy: str, signal_number: int) -> tuple[Path, dict]:
        if (strategy, signal_number) not in outcomes:
            out = root / f"{strategy}-{signal_number}"
            out.mkdir()
            outcomes[strategy, signal_number] = out, kill_caller(out, strategy, signal_number)
        return outcomes[strategy, signal_number]
    yield run
    shutil.rmtree(root, ignore_errors=True)


@pytest.mark.parametrize("signal_number", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_no_process_outlives_a_killed_caller(killed, strategy, signal_number):
    out, outcome = killed(strategy, signal_number)
    assert not outcome["left"], f"still running {ENDED_WITHIN_SECONDS} s after the caller's signal: {outcome}"
    # under SIGTERM the caller stopped its ranks, then ended as SIGTERM ends a process
    assert outcome["returncode"] == -signal_number, (out / "stderr.txt").read_text()[-3000:]
    # rank 0, ended by SIGTERM, cleaned up: the checkpoint it was rewriting is whole, its temporary file removed
    assert load_data(out / "checkpoint.pt")["data"].equal(torch.arange(200_000))
    assert not list(out.glob(".tmp-*")), "a rank's temporary file was left behind"


def _first_draws(seed: int) -> tuple:
    """What a process seeded with `seed` draws first from Python's `random`, numpy and torch."""
    return (random.Random(seed).random(), float(np.random.RandomState(seed).rand()),
            torch.rand(1, generator=torch.Generator().manual_seed(seed)).item())


@pytest.mark.parametrize("strategy", SEEDED)
def test_the_ranks_start_from_the_caller_s_random_state(killed, strategy):
    out, _ = killed(strategy, signal.SIGKILL)
    first, again, other = torch.load(out / "seeded.pt", weights_only=False)
    assert first["draws"] == _first_draws(1) and other["draws"] == _first_draws(2)
    for name, value in first["weights"].items():
        assert torch.equal(value, again["weights"][name]), f"{name}: the same seed trained other weights"
    assert any(not torch.equal(value, other["weights"][name]) for name, value in first["weights"].items()), \
        "seeds 1 and 2 drew the same Dropout masks"


def test_the_fork_server_outlives_the_thread_that_started_it(killed):
    """It dies with the thread that started it (PR_SET_PDEATHSIG): a fit in a thread that has ended since must not
    leave the next fit to start a new one, or to find none."""
    out, _ = killed("ddp_spawn", signal.SIGKILL)
    servers = {fit["parent"] for fit in torch.load(out / "seeded.pt", weights_only=False)}
    later = {rank["parent"] for rank in map(json.loads, map(Path.read_text, out.glob("rank-*.json")))}
    assert len(servers) == 1 and later == servers, (servers, later)


def test_sigterm_inside_a_launch_runs_its_clean_up_then_a_handler_the_script_installed():
    """A script's own SIGTERM handler still runs, after the launch's clean-up (the default action is checked above,
    by the callers' exit status)."""
    received, cleaned = [], []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: received.append(signum))
    try:
        with pytest.raises(Terminated):
            with cleaned_up_on_sigterm():
                try:
                    signal.pthread_kill(threading.get_ident(), signal.SIGTERM)   # its handler raises in here
                    pytest.fail("SIGTERM did not interrupt the block")
                finally:
                    cleaned.append(received[:])
        assert cleaned == [[]] and received == [signal.SIGTERM]   # the clean-up ran first, then the script's handler
    finally:
        signal.signal(signal.SIGTERM, previous)
