"""A failure in any rank stops every rank promptly, with the failing rank's original traceback; nothing is orphaned."""
from __future__ import annotations

import os
import re
import shutil
import signal
import tempfile
import time
import uuid

import pytest
from runner import processes_running, run_script, start_script

pytestmark = pytest.mark.timeout(240)
LAUNCHERS = ["ddp", "ddp_spawn", "ddp_fork"]


@pytest.fixture
def env():
    """The run's variables: a marker its processes carry, and a temporary folder of its own (short, so that
    ddp_spawn's ranks still start from its fork server, whose socket a pytest tmp_path is too long a path for)."""
    folder = tempfile.mkdtemp(prefix="failures-")
    yield {"EASYFIT_TEST_MARKER": uuid.uuid4().hex, "TMPDIR": folder}
    shutil.rmtree(folder, ignore_errors=True)


def _failure_time(stderr: str) -> float:
    match = re.search(r"FAILING_AT ([0-9.]+)", stderr)
    assert match, stderr[-3000:]
    return float(match.group(1))


#: how long a failure may take to stop every rank: generous, so that a loaded machine does not fail the tests; a run
#: that hung instead would take minutes (50 epochs, or the process group's timeout)
PROMPT_SECONDS = 60


def _assert_no_orphans(env: dict) -> None:
    """Wait for the event (every marked process gone, read from /proc) with a generous deadline; then no temporary
    file or folder of the run is left either."""
    deadline = time.monotonic() + 30
    while processes_running(env["EASYFIT_TEST_MARKER"]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert processes_running(env["EASYFIT_TEST_MARKER"]) == []
    assert [name for name in os.listdir(env["TMPDIR"]) if not _torchs_own(os.path.join(env["TMPDIR"], name))] == []


def _torchs_own(path: str) -> bool:
    """What torch itself keeps in the temporary folder: its compiler's cache (made when its optimizers first import
    the compiler), and on older releases the folder of its remote-module template (made when torch.distributed.nn is
    imported, removed at a clean exit only)."""
    name = os.path.basename(path)
    return name.startswith("torchinductor_") or (
        name.startswith("tmp") and set(os.listdir(path)) <= {"_remote_module_non_scriptable.py"})


@pytest.mark.parametrize("strategy", LAUNCHERS)
def test_exception_in_rank_1_stops_all_ranks_with_its_traceback(strategy, tmp_path, env):
    process = run_script(tmp_path, strategy, "--fail-rank", "1", "--fail-step", "3", "--epochs", "50", env=env)
    finished = time.time()
    assert process.returncode != 0
    assert "rank 1 failed" in process.stderr
    assert "deliberate failure on rank 1 at step 3" in process.stderr
    assert "Traceback" in process.stderr and "on_train_batch_end" in process.stderr
    assert finished - _failure_time(process.stderr) < PROMPT_SECONDS
    _assert_no_orphans(env)


@pytest.mark.parametrize("strategy", ["ddp", "ddp_spawn"])
def test_rank_killed_by_a_signal_stops_all_ranks(strategy, tmp_path, env):
    process = run_script(tmp_path, strategy, "--fail-rank", "1", "--fail-mode", "kill", "--epochs", "50", env=env)
    finished = time.time()
    assert process.returncode != 0
    assert "rank 1 failed" in process.stderr and "SIGKILL" in process.stderr
    assert finished - _failure_time(process.stderr) < PROMPT_SECONDS
    _assert_no_orphans(env)


def test_exception_in_rank_0_stops_the_other_ranks(tmp_path, env):
    process = run_script(tmp_path, "ddp", "--fail-rank", "0", "--epochs", "50", env=env)
    assert process.returncode != 0
    assert "deliberate failure on rank 0 at step 3" in process.stderr
    assert time.time() - _failure_time(process.stderr) < PROMPT_SECONDS
    _assert_no_orphans(env)


@pytest.mark.parametrize("strategy", ["ddp", "ddp_spawn"])
def test_ctrl_c_in_the_caller_stops_every_rank(strategy, tmp_path, env):
    process = start_script(tmp_path, strategy, "--fail-rank", "1", "--fail-mode", "hang", "--epochs", "50", env=env)
    try:
        stderr = ""
        while "FAILING_AT" not in stderr:
            line = process.stderr.readline()
            assert line, "the script ended before rank 1 reached the hang"
            stderr += line
        process.send_signal(signal.SIGINT)
        process.wait(timeout=15)
    finally:
        process.kill()
    assert process.returncode != 0
    _assert_no_orphans(env)


def test_a_rank_failing_before_its_first_call_stops_the_run_at_once(tmp_path, env):
    process = run_script(tmp_path, "ddp", "--fail-before-fit", "1", env=env)
    assert process.returncode != 0
    assert "rank 1 failed" in process.stderr
    assert "deliberate failure before fit on local rank 1" in process.stderr
    assert time.time() - _failure_time(process.stderr) < PROMPT_SECONDS
    _assert_no_orphans(env)


def test_a_script_that_catches_a_rank_failure_cannot_fit_again_without_its_ranks(tmp_path, env):
    process = run_script(tmp_path, "ddp", "--fail-rank", "1", "--retry-after-failure", "--epochs", "50", env=env)
    assert process.returncode != 0
    assert "cannot be started again mid-script" in process.stderr
    _assert_no_orphans(env)
