"""What a user hears from 2 CPU processes: a failure's cause in words, a stuck rank by name, and what rank 0's
callbacks and warnings hold back in the caller. Each test runs tests/distributed/scripts/rank_reports.py."""
from __future__ import annotations

import json

import pytest
from runner import finished, launch_early, run_script

from easyfit.distributed.launchers.failures import RankFailedError, root_cause

pytestmark = pytest.mark.timeout(240)


def run(tmp_path, scenario: str, strategy: str):
    return run_script(tmp_path, scenario, strategy, script="rank_reports.py")


@pytest.fixture(scope="module", autouse=True)
def stuck_under_the_script_launcher(request, tmp_path_factory):
    """The stuck scenario waits out its 15 s collective timeout while the module's other tests run."""
    yield from launch_early(request, tmp_path_factory, "test_a_stuck_rank_under_the_script_launcher_is_named",
                            "stuck", "popen", script="rank_reports.py")


@pytest.mark.parametrize("strategy", ["ddp", "ddp_spawn", "ddp_fork"])
def test_a_parameter_without_gradient_on_one_rank_names_the_fix(strategy, tmp_path):
    process = run(tmp_path, "unused", strategy)
    assert process.returncode != 0
    assert "rank 1 failed" in process.stderr, process.stderr[-3000:]
    assert "parameter(s) extra.weight, extra.bias of the net got no gradient on rank 1" in process.stderr
    assert "strategy=easyfit.strategies.DDP(find_unused_parameters=True)" in process.stderr
    assert "SIGABRT" not in process.stderr


def test_a_stuck_rank_under_the_script_launcher_is_named(stuck_under_the_script_launcher):
    process = finished(stuck_under_the_script_launcher[1])
    assert process.returncode != 0
    assert "rank(s) 1 did not reach a collective in time" in process.stderr, process.stderr[-3000:]


@pytest.mark.parametrize("strategy", ["ddp_spawn", "ddp_fork"])
def test_callback_attributes_and_rank_zero_warnings_come_back_to_the_caller(strategy, tmp_path):
    process = run(tmp_path, "hand_back", strategy)
    assert process.returncode == 0, process.stderr[-3000:]
    caller = json.loads((tmp_path / "caller.json").read_text())
    assert caller["message"].startswith("TerminateOnNaN: the training loss is nan at epoch 1, batch 4")
    assert caller["batches"] == 4 and caller["ranks"] == [0]
    assert "a warning raised on rank 0" in caller["warnings"]
    assert caller["message"] in caller["warnings"]


def test_a_ranks_own_traceback_outranks_a_rank_the_collective_library_aborted():
    aborted = RankFailedError(0, "killed by signal SIGABRT")
    raised = RankFailedError(1, "Traceback (most recent call last):\nRuntimeError: the cause")
    assert root_cause([aborted, raised]) is raised
    assert root_cause([aborted]) is aborted
