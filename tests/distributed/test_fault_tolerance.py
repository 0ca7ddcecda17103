"""Fault tolerance for real: ranks killed (SIGKILL) or failing in a callback under torchrun and under easyfit's own
`max_restarts`; every restarted attempt continues from the fault-tolerance checkpoint, and the finished run equals one
that never failed: its weights bit for bit, its whole History (loss, metric, validation) within 1e-6. The fit is a
user's (a metric, validation data, an LR scheduler). Some runs combine several failures (one per attempt) to keep the
suite short."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from runner import SCRIPTS, processes_running

from easyfit.distributed.environments import find_free_port

pytestmark = pytest.mark.timeout(240)
SCRIPT = str(SCRIPTS / "elastic.py")
KILL_THEN_RAISE = ["--every", "1", "--fail", "0:kill:1:1:2", "1:raise:1:2:1"]   # epoch 2 batch 2, epoch 3 batch 1


def _run(out: Path, *command: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run a command in `out` (the fault-tolerance checkpoints' default folder is where the script starts)."""
    out.mkdir(exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run(list(command), cwd=out, env=env, capture_output=True, text=True, timeout=200)


def _torchrun(out: Path, *options: str) -> list[str]:
    """torchrun with `options`, its logs in `out` (else it leaves a folder of them in /tmp each run)."""
    return [sys.executable, "-m", "torch.distributed.run", "--log-dir", str(out / "torchrun-logs"), *options]


def _result(out: Path) -> dict:
    return torch.load(out / "result.pt", weights_only=False)


def _assert_same_run(outcome: dict, expected: dict) -> None:
    """Bit for bit the weights of the run that never failed; every epoch once in the History, each of its values
    (the interrupted epoch's training accuracy included) that run's; the callback's count carried over the
    restarts."""
    for name, value in expected["state"].items():
        assert (outcome["state"][name] - value).abs().max().item() == 0.0, name
    history = outcome["history"]
    assert sorted(history) == ["accuracy", "loss", "val_accuracy", "val_loss"] and len(history["loss"]) == 4
    for key, values in expected["history"].items():
        assert history[key] == pytest.approx(values, abs=1e-6), key
    assert outcome["count"] == expected["count"] == 16


def _assert_checkpoints_deleted(out: Path) -> None:
    """The checkpoint, and its default folder with it, is gone once the fit has ended well."""
    assert not (out / ".easyfit-fault-tolerance").exists()


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> dict:
    """The same fit, 2 processes (easyfit's launcher, ddp), never failing and without fault tolerance; a
    ModelCheckpoint every 3 batches (4 an epoch) leaves ck-3-1.pt, written in the middle of the third epoch."""
    out = tmp_path_factory.mktemp("uninterrupted")
    process = _run(out, sys.executable, SCRIPT, str(out), "--save-every", "3")
    assert process.returncode == 0, process.stderr[-3000:]
    return {**_result(out), "folder": out}


@pytest.mark.parametrize("strategy, failures", [
    # one run, three failures: rank 0 (the caller's process) raises in epoch 2, rank 1 raises in epoch 3, rank 1 is
    # killed mid-epoch 4
    ("ddp", ("0:raise:0:1:1", "1:raise:1:2:1", "2:kill:1:3:1")),
    ("fsdp", ("0:kill:1:1:1",)),          # rank 1 killed mid-epoch 2, sharded
    ("ddp_spawn", ("0:raise:1:1:1",)),    # spawned ranks: every attempt starts from a copy of the caller's objects
], ids=["ddp", "fsdp", "ddp_spawn"])
def test_max_restarts_restart_a_fit_with_a_metric_that_continues_exactly(uninterrupted, tmp_path, strategy, failures):
    """fit(max_restarts=len(failures)) with a fault-tolerance checkpoint every step: each failure in batch 1 of an
    epoch (before its checkpoint) restarts every rank, which resume after batch 0, the epoch's loss and accuracy so
    far included (before, the accuracy logged for the epoch counted batches 1-3 only). Before too, rank 0 of the
    script re-run kept the first attempt's metrics, whose task it had already shared, and the new rank 1 waited in
    another collective: the restarted attempt failed again."""
    process = _run(tmp_path, sys.executable, SCRIPT, str(tmp_path), "--strategy", strategy, "--max-restarts",
                   str(len(failures)), "--every", "1", "--fail", *failures)
    assert process.returncode == 0, process.stderr[-5000:]
    for restart, failure in enumerate(failures, 1):
        _, _, rank, epoch, _ = failure.split(":")
        assert f"easyfit: attempt {restart} failed: rank {rank}: " in process.stderr
        assert f"resumed after restart {restart} from epoch {int(epoch) + 1}, step 1" in process.stderr
    _assert_same_run(_result(tmp_path), uninterrupted)
    _assert_checkpoints_deleted(tmp_path)


def test_torchrun_restarts_a_ddp_fit_killed_mid_epoch_that_continues_exactly(uninterrupted, tmp_path):
    """Rank 0 killed in batch 1 of epoch 2 (a checkpoint every step): the restarted workers resume at step 1 with
    the epoch's loss and each rank's accuracy state so far (before, epoch 2's accuracy counted batches 1-3 only)."""
    process = _run(tmp_path, *_torchrun(tmp_path, "--standalone", "--nproc-per-node=2", "--max-restarts=1"), SCRIPT,
                   str(tmp_path), "--every", "1", "--fail", "0:kill:0:1:1")
    assert process.returncode == 0, process.stderr[-5000:]
    assert "resumed after restart 1 from epoch 2, step 1" in process.stderr
    _assert_same_run(_result(tmp_path), uninterrupted)
    _assert_checkpoints_deleted(tmp_path)


def test_torchrun_restarts_a_tensor_parallel_fit_killed_mid_epoch_that_continues_exactly(tmp_path):
    """strategy="tp" on 2 ranks, rank 1 killed in batch 1 of epoch 2 (a checkpoint every step): the restarted
    workers rebuild the mesh, load the full fault-tolerance checkpoint into their shards and end as the same tp fit
    that never failed."""
    torchrun = _torchrun(tmp_path, "--standalone", "--nproc-per-node=2", "--max-restarts=1")
    uninterrupted = _run(tmp_path / "uninterrupted", *torchrun, SCRIPT, str(tmp_path / "uninterrupted"),
                         "--strategy", "tp")
    assert uninterrupted.returncode == 0, uninterrupted.stderr[-5000:]
    process = _run(tmp_path / "killed", *torchrun, SCRIPT, str(tmp_path / "killed"), "--strategy", "tp", "--every",
                   "1", "--fail", "0:kill:1:1:1")
    assert process.returncode == 0, process.stderr[-5000:]
    assert "resumed after restart 1 from epoch 2, step 1" in process.stderr
    _assert_same_run(_result(tmp_path / "killed"), _result(tmp_path / "uninterrupted"))
    _assert_checkpoints_deleted(tmp_path / "killed")


def test_a_mid_epoch_model_checkpoint_resumes_on_two_processes_with_the_whole_history(uninterrupted, tmp_path):
    """fit(resume_from=) a ModelCheckpoint written after batch 1 of epoch 3 by the uninterrupted run: rank 0 carries
    the loss both ranks summed before it, each rank its own accuracy state (before, every rank restored rank 0's own
    loss, and the accuracy counted the batches after the resume only)."""
    process = _run(tmp_path, sys.executable, SCRIPT, str(tmp_path), "--save-every", "3", "--resume",
                   str(uninterrupted["folder"] / "ck-3-1.pt"))
    assert process.returncode == 0, process.stderr[-5000:]
    _assert_same_run(_result(tmp_path), uninterrupted)


def test_torchrun_restarts_a_sharded_fit_that_continues_exactly(uninterrupted, tmp_path):
    """fsdp with a sharded checkpoint (a folder every rank writes) under torchrun --standalone: rank 1 killed in
    epoch 2, then raising in epoch 3; the restarted workers meet and continue."""
    process = _run(tmp_path, *_torchrun(tmp_path, "--standalone", "--nproc-per-node=2", "--max-restarts=2"), SCRIPT,
                   str(tmp_path), "--strategy", "fsdp-sharded", *KILL_THEN_RAISE)
    assert process.returncode == 0, process.stderr[-5000:]
    assert "deliberate failure on rank 1 in epoch 3, batch 1" in process.stderr
    assert "resumed after restart 1 from epoch 2, step 2" in process.stderr
    assert "resumed after restart 2 from epoch 3, step 1" in process.stderr
    _assert_same_run(_result(tmp_path), uninterrupted)
    _assert_checkpoints_deleted(tmp_path)


def test_easyfit_max_restarts_restart_every_rank_and_continue_exactly(uninterrupted, tmp_path):
    """easyfit.launch(max_restarts=2) at the top of the script (fit's own max_restarts: see
    tests/saving/test_restarts_and_requeue.py); the ranks re-run for ddp are restarted after each failure. With the
    user's MASTER_PORT every attempt meets on the same port, where the previous attempt's keys may still be."""
    process = _run(tmp_path, sys.executable, SCRIPT, str(tmp_path), "--launch-restarts", "2", *KILL_THEN_RAISE,
                   env={"MASTER_PORT": str(find_free_port())})
    assert process.returncode == 0, process.stderr[-5000:]
    assert ("easyfit: attempt 1 failed: rank 1: killed by signal SIGKILL; restarting every rank (restart 1 of 2)"
            in process.stderr)
    assert ("easyfit: attempt 2 failed: rank 1: RuntimeError: deliberate failure on rank 1 in epoch 3, batch 1; "
            "restarting every rank (restart 2 of 2)") in process.stderr
    assert "resumed after restart 2 from epoch 3, step 1" in process.stderr
    _assert_same_run(_result(tmp_path), uninterrupted)
    _assert_checkpoints_deleted(tmp_path)
    assert processes_running(str(tmp_path)) == []


def test_a_restart_on_fewer_processes_reshards_the_data_and_rescales_the_lr(tmp_path):
    """A node lost (its torchrun agent killed in epoch 2); the run goes on on one process with the same run id: every
    sample of each epoch trained once, and the summary line says what changed."""
    rendezvous = ["--rdzv-backend=c10d", "--rdzv-endpoint=127.0.0.1:0", f"--rdzv-id=shrink-{os.getpid()}",
                  "--max-restarts=1"]
    lost = _run(tmp_path, *_torchrun(tmp_path, *rendezvous, "--nproc-per-node=2"), SCRIPT, str(tmp_path), "--record",
                "--every", "2", "--fail", "0:lose-node:0:1:2")
    assert lost.returncode != 0
    process = _run(tmp_path, *_torchrun(tmp_path, *rendezvous, "--nproc-per-node=1"), SCRIPT, str(tmp_path), "--record",
                   "--every", "2")
    assert process.returncode == 0, process.stderr[-5000:]
    outcome = _result(tmp_path)
    assert outcome["world_size"] == 1 and len(outcome["history"]["loss"]) == 4
    assert ("resumed the run's checkpoint from epoch 2, step 2; world size 2 → 1: the data re-sharded over 1 "
            "process (the epoch continues at step 4), lr 0.1 → 0.05") in outcome["summary"]
    assert "counts only" not in outcome["summary"]   # both ranks' accuracy states merged into the one left
    before = _seen(tmp_path, "seen-2-0-*.txt", epoch=1, batches=range(2))   # trained before the checkpoint
    after = {epoch: _seen(tmp_path, "seen-1-0-0.txt", epoch) for epoch in (1, 2, 3)}
    assert sorted(before + after[1]) == list(range(128))
    assert sorted(after[2]) == sorted(after[3]) == list(range(128))
    _assert_checkpoints_deleted(tmp_path)


def _seen(out: Path, pattern: str, epoch: int, batches=None) -> list[int]:
    """The sample indices the recording ranks trained in `epoch` (optionally only in `batches`)."""
    indices = []
    for path in out.glob(pattern):
        for line in path.read_text().splitlines():
            at_epoch, batch, *samples = map(int, line.split())
            if at_epoch == epoch and (batches is None or batch in batches):
                indices += samples
    return indices
