"""Common script patterns on 2 CPU processes: every rank agrees, every failure arrives with its cause, nothing
hangs. Each test runs tests/distributed/scripts/patterns.py as a real program with a timeout; the scenarios that end
well on every rank share one launch (starting the processes is what costs time)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from runner import SCRIPTS, finished, launch_early, make_net

import easyfit
from easyfit.distributed.launchers.failures import exchange_directory
from easyfit.saving.resume import EpochPosition
from easyfit.training.on_rank import step_rates
from easyfit.training.plan import FitOptions


def run_pattern(out: Path, scenario: str, timeout: float = 240, cwd: Path | None = None,
                env: dict | None = None, typed: str | None = None) -> subprocess.CompletedProcess:
    """The scenario as a real program; `typed`: its standard input (none: end-of-file at once)."""
    environment = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run([sys.executable, str(SCRIPTS / "patterns.py"), str(out), scenario], env=environment,
                          capture_output=True, text=True, timeout=timeout, cwd=cwd, input=typed,
                          stdin=subprocess.DEVNULL if typed is None else None)


def ranks(out: Path) -> list[dict]:
    return [json.loads((out / f"rank-{rank}.json").read_text()) for rank in range(2)]


def succeeded(process: subprocess.CompletedProcess) -> None:
    assert process.returncode == 0, process.stderr[-4000:]


def failed_with(process: subprocess.CompletedProcess, words: str) -> None:
    assert process.returncode != 0
    assert words in process.stderr, process.stderr[-4000:]


@pytest.fixture(scope="module")
def agreeing(tmp_path_factory) -> tuple[Path, list[dict]]:
    """One launch of the scenarios that end well (patterns.py's AGREEING), shared by their tests; started in its
    folder, with a line typed on its standard input."""
    out = tmp_path_factory.mktemp("agreeing")
    (out / "sub").mkdir()
    succeeded(run_pattern(out, "agreeing", cwd=out, typed="go\n"))
    return out, ranks(out)


def test_evaluate_and_predict_with_defaults_after_a_ddp_fit_run_on_every_rank_exactly(agreeing):
    first, second = (rank["evaluate_after_fit"] for rank in agreeing[1])
    assert first["scores"] == second["scores"]
    assert first["predictions"] == second["predictions"] == [128, 3]
    assert first["world_size"] == second["world_size"] == 2


def test_a_rank_local_call_keeps_the_rank_identity(agreeing):
    out, found = agreeing
    assert [tuple(r["single_among_ranks"]["identity"]) for r in found] == [(0, 2), (1, 2)]
    assert len(list(out.glob("saved-by-pid-*.pt"))) == 1, "only global rank 0 saved"


def test_easyfit_launch_gives_every_rank_its_identity_before_the_first_call(tmp_path):
    succeeded(run_pattern(tmp_path, "early_launch"))
    assert [tuple(r["identity"]) for r in ranks(tmp_path)] == [(0, 2), (1, 2)]


def test_stop_training_on_one_rank_stops_every_rank_at_the_same_step(agreeing):
    first, second = (rank["stop_on_one_rank"] for rank in agreeing[1])
    assert first["steps"] == second["steps"] == 3
    assert first["epochs"] == second["epochs"] == 1


def test_different_batch_counts_per_rank_fail_with_what_differs(tmp_path):
    failed_with(run_pattern(tmp_path, "uneven"),
                "different numbers of training batches per epoch (rank 0: 4, rank 1: 3)")


def test_an_iterable_dataset_with_fewer_batches_on_one_rank_trains_to_the_same_weights(agreeing):
    """6 batches on rank 0, 5 on rank 1: the rank that runs out shadows the other's all-reduces (torch's join)."""
    first, second = (rank["uneven_iterable"] for rank in agreeing[1])
    assert first["weights"] == second["weights"]


def test_a_failure_caught_by_the_script_still_reaches_rank_zero_with_its_cause(tmp_path):
    run_pattern(tmp_path, "catch_and_continue")
    assert "deliberate failure on rank 1" in json.loads((tmp_path / "rank-0.json").read_text())["error"]


def test_sys_exit_in_a_callback_on_one_rank_is_reported(tmp_path):
    run_pattern(tmp_path, "exit_in_callback")
    assert "sys.exit(0) in the middle of a fit" in json.loads((tmp_path / "rank-0.json").read_text())["error"]


def test_a_call_made_by_rank_zero_only_fails_with_words_that_say_so(tmp_path):
    failed_with(run_pattern(tmp_path, "only_rank_zero_calls"), "ended without making the call")


def test_a_rank_that_exits_with_code_0_before_its_first_call_fails_the_call(tmp_path):
    failed_with(run_pattern(tmp_path, "exit_before_call"), "exited (code 0) before reaching")


def test_predict_with_fewer_samples_than_processes(agreeing):
    assert [r["predict_one_sample"]["shape"] for r in agreeing[1]] == [[1, 3], [1, 3]]


def test_re_run_ranks_start_where_the_script_was_started(agreeing):
    """The script changes into "sub" (relative) before its first call: the re-run rank must start where the script
    was started to land there too."""
    out, found = agreeing
    assert [r["cwd"] for r in found] == [str(out / "sub")] * 2


def test_spawned_ranks_hand_back_the_callbacks_states(tmp_path):
    succeeded(run_pattern(tmp_path, "spawn_callbacks"))
    result = json.loads((tmp_path / "rank-0.json").read_text())
    assert result["stopped_epoch"] == 1 and result["epochs"] == 2


def test_ddp_fork_with_a_lambda_loss_and_a_local_net_returns_the_history(tmp_path):
    succeeded(run_pattern(tmp_path, "fork_lambda_loss"))
    assert json.loads((tmp_path / "rank-0.json").read_text())["epochs"] == 2


@pytest.fixture(scope="module", autouse=True)
def stuck(request, tmp_path_factory):
    """The stuck scenario waits out its 5 s collective timeout while the module's other tests run."""
    yield from launch_early(request, tmp_path_factory, "test_a_stuck_rank_is_named", "stuck", script="patterns.py")


def test_a_stuck_rank_is_named(stuck):
    failed_with(finished(stuck[1]), "rank(s) 1 did not reach a collective in time")


def test_children_read_no_terminal_input(agreeing):
    """The script reads input() before its first call: the re-run rank gets end-of-file at once instead of blocking,
    and the script's own process reads what was typed."""
    assert [r["answer"] for r in agreeing[1]] == ["go", "eof"]


def test_an_error_before_the_first_call_arrives_with_its_traceback(tmp_path):
    script = tmp_path / "fails_early.py"
    script.write_text("import os\nimport easyfit, torch\nmodel = easyfit.Model(torch.nn.Linear(2, 2))\n"
                      "if os.environ.get('LOCAL_RANK') == '1':\n    raise FileNotFoundError('no data on rank 1')\n"
                      "model.fit(torch.randn(8, 2), torch.zeros(8).long(), verbose=0, devices=2, accelerator='cpu',"
                      " strategy='ddp')\n")
    finished = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=240)
    assert finished.returncode != 0
    reported = finished.stderr.split("rank 1 failed; all ranks were stopped. Its error:")[-1]
    assert "FileNotFoundError: no data on rank 1" in reported and "Traceback" in reported


def test_slurm_variables_without_srun_say_who_is_missing(tmp_path):
    """SLURM says 2 tasks but only one process runs: after a while it says whom it waits for, and why."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "SLURM_NTASKS": "2", "SLURM_PROCID": "0", "SLURM_LOCALID": "0",
           "SLURM_NODEID": "0", "SLURM_NNODES": "1", "SLURM_JOB_ID": "4242", "SLURM_NODELIST": "localhost",
           "SLURM_NTASKS_PER_NODE": "2", "SLURM_JOB_NAME": "train", "MASTER_PORT": "29555"}
    # the notice comes after PEER_WAIT_NOTICE_SECONDS (15 s); this run of the script says it after 1 s
    says_it_sooner = ("import runpy, sys; import easyfit.distributed.strategies.parallel as parallel; "
                      "parallel.PEER_WAIT_NOTICE_SECONDS = 1.0; sys.argv = sys.argv[1:]; "
                      "runpy.run_path(sys.argv[0], run_name='__main__')")
    process = subprocess.Popen([sys.executable, "-c", says_it_sooner, str(SCRIPTS / "patterns.py"), str(tmp_path),
                                "exit_before_call"], env=env, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL,
                               text=True)
    try:
        while True:   # the event: the notice line (the test's timeout bounds the wait)
            line = process.stderr.readline()
            assert line, "the process ended without the notice"
            if "to join the process group" in line:
                break
        assert "srun" in line and "rank(s) 1" in line
    finally:
        process.send_signal(signal.SIGKILL)
        process.wait()


def test_leftover_exchange_folders_of_killed_callers_are_removed():
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    leftover = Path(tempfile.gettempdir()) / f"easyfit-ranks-{dead.pid}-left"
    leftover.mkdir()
    fresh = exchange_directory("ranks")
    try:
        assert not leftover.exists()
        assert Path(fresh).name.startswith(f"easyfit-ranks-{os.getpid()}-")
    finally:
        os.rmdir(fresh)


def test_warmup_counts_the_real_optimizer_steps_with_accumulation():
    """8 batches with accumulation 3 make 3 optimizer steps (the last window is short), not 8 // 3 = 2."""
    model = easyfit.Model(make_net(), lr=0.1)
    options = FitOptions(batch_size=16, gradient_accumulation_steps=3, lr_warmup_epochs=1)
    rates = step_rates(options, [None] * 8, model.optimizer, 2.0, 0, EpochPosition())
    assert rates.warmup_steps == 3
