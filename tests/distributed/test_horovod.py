"""strategy="horovod" on 2 CPU processes (Gloo), launched by horovod.run (plain script) and by horovodrun.

Parity: Adam + StepLR under Horovod trains what plain PyTorch trains on the combined batch, with and without
gradient accumulation, straight or resumed from a checkpoint. Evaluation is exact. A failing rank reaches the
caller with its traceback, and no rank outlives the call.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time

import pytest
import torch
from runner import (
    SCRIPTS,
    assert_exact_evaluation,
    assert_same_weights,
    make_data,
    make_net,
    processes_running,
    reference_weights,
    result,
    run_script,
)

import easyfit
from easyfit.distributed.strategy_parts.cpu_threads import available_cores

pytest.importorskip("horovod.torch", reason="horovod is not installed: scripts/install_horovod.sh builds it")
pytestmark = pytest.mark.timeout(300)

RANK_PROCESS = "horovod.runner.run_task"   # the command line of every rank horovod.run starts


def adam_reference(accumulate: int = 1, epochs: int = 2, batch: int = 32) -> dict:
    """Plain PyTorch on one process: Adam, StepLR(1, 0.5) per epoch, the combined batch of both ranks, each
    accumulation window's losses divided by the window length (a short last window too, as easyfit does)."""
    from horovod_train import GAMMA, LR
    x, y = make_data()
    net = make_net()
    optimizer = torch.optim.Adam(net.parameters(), lr=LR)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=GAMMA)
    starts = list(range(0, len(x), batch))
    for _ in range(epochs):
        for step, start in enumerate(starts):
            if step % accumulate == 0:
                optimizer.zero_grad()
            loss = torch.nn.functional.cross_entropy(net(x[start:start + batch]), y[start:start + batch])
            (loss / accumulate).backward()
            if (step + 1) % accumulate == 0 or step + 1 == len(starts):
                optimizer.step()
        scheduler.step()
    return net.state_dict()


def _wait_until_no_ranks(timeout: float = 30.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while processes_running(RANK_PROCESS) and time.monotonic() < deadline:
        time.sleep(0.1)
    return processes_running(RANK_PROCESS)


def max_difference(actual: dict, expected: dict) -> float:
    return max((actual[name] - value).abs().max().item() for name, value in expected.items())


@pytest.mark.parametrize("accumulate", [1, 3])
def test_horovod_run_matches_plain_pytorch_on_the_combined_batch(accumulate, tmp_path):
    """devices=2 from a plain script: horovod.run starts the ranks; 3 accumulation steps leave a short window.
    Evaluation does not depend on how the weights were trained: the run without accumulation checks it."""
    fits_only = ["--fits-only"] if accumulate > 1 else []
    process = run_script(tmp_path, "--accumulate", str(accumulate), *fits_only, script="horovod_train.py",
                         timeout=240)
    assert process.returncode == 0, process.stderr[-4000:]
    outcome = result(tmp_path)
    expected = adam_reference(accumulate)
    print(f"max |horovod - torch| = {max_difference(outcome['state'], expected):.2e}")
    assert_same_weights(outcome["state"], expected, atol=1e-5)
    assert outcome["params"]["world_size"] == 2 and outcome["params"]["strategy"] == "horovod"
    assert outcome["params"]["batch_factor"] == 2, "the LR scaling factor is hvd.size()"
    assert outcome["lr_after"] == pytest.approx(0.01 * 0.5 ** 2), "the schedule acted on the stepping optimizer"
    assert outcome["optimizer"]["state"], "the optimizer state came back to the caller"
    if not fits_only:
        assert_exact_evaluation(outcome)
    restored = easyfit.Model.load(tmp_path / "checkpoint.pt", net=make_net())
    assert_same_weights(restored.net.state_dict(), outcome["state"], atol=0)
    assert _wait_until_no_ranks() == []


def test_resume_from_a_checkpoint_continues_exactly(tmp_path):
    """Epoch 1, save, a new Model resumes epoch 2: Adam's state and the schedule come back on every rank."""
    process = run_script(tmp_path, "--resume", "--fits-only", script="horovod_train.py", timeout=240)
    assert process.returncode == 0, process.stderr[-4000:]
    outcome = result(tmp_path)
    assert_same_weights(outcome["state"], adam_reference(), atol=1e-5)
    assert len(outcome["history"]["loss"]) == 2


@pytest.mark.skipif(shutil.which("horovodrun") is None, reason="horovodrun is not on PATH")
def test_horovodrun_ranks_match_plain_pytorch_and_agree(tmp_path):
    """`horovodrun --gloo -np 2 -H localhost:2 python train.py`: every rank runs the script."""
    command = ["horovodrun", "--gloo", "-np", "2", "-H", "localhost:2", "--network-interfaces", "lo",
               sys.executable, str(SCRIPTS / "horovod_train.py"), str(tmp_path), "--accumulate", "3"]
    process = subprocess.run(command, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                             timeout=240, check=False)
    assert process.returncode == 0, process.stdout[-3000:] + process.stderr[-3000:]
    outcome = result(tmp_path)
    assert_same_weights(outcome["state"], adam_reference(3), atol=1e-5)
    assert_exact_evaluation(outcome)
    ranks = [torch.load(tmp_path / f"rank-{rank}.pt") for rank in (0, 1)]
    assert_same_weights(ranks[1], ranks[0], atol=0)


def test_a_failing_rank_reaches_the_caller_with_its_traceback(tmp_path):
    process = run_script(tmp_path, "horovod", "--fail-rank", "1", "--fail-step", "2", timeout=240)
    assert process.returncode != 0
    assert "RankFailedError: rank 1 failed" in process.stderr
    assert "deliberate failure on rank 1 at step 2" in process.stderr
    assert _wait_until_no_ranks() == []


class FailOnRankOne(easyfit.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        if self.model.global_rank == 1 and batch == 1:
            raise ValueError("rank one gives up")


def test_in_process_fit_under_pytest_raises_rank_failed_error_with_the_original_error():
    """Functions horovod.run sends travel by cloudpickle; a test module is not importable in the ranks, so it is
    pickled by value."""
    import cloudpickle

    from easyfit.distributed.launchers import RankFailedError
    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    try:
        x, y = make_data()
        model = easyfit.Model(make_net(), "cross_entropy", "sgd")
        with pytest.raises(RankFailedError) as failure:
            model.fit(x, y, epochs=1, batch_size=16, verbose=0, callbacks=[FailOnRankOne()], devices=2,
                      accelerator="cpu", strategy="horovod")
    finally:
        cloudpickle.unregister_pickle_by_value(sys.modules[__name__])
    assert failure.value.rank == 1
    assert "ValueError: rank one gives up" in failure.value.details
    assert _wait_until_no_ranks() == []



def test_fp16_compression_trains_within_tolerance_of_full_precision():
    """Horovod(compression="fp16") all-reduces float16 gradients: 8 SGD steps end within 1e-4 of full precision
    (rounding to 11 significant bits), and not exactly on it."""
    from easyfit.strategies import Horovod
    x, y = make_data()
    net = make_net()
    model = easyfit.Model(net, "cross_entropy", torch.optim.SGD(net.parameters(), lr=0.1))
    model.fit(x, y, epochs=2, batch_size=16, shuffle=False, verbose=0, lr_scaling=None, devices=2,
              accelerator="cpu", strategy=Horovod(compression="fp16"))
    difference = max_difference(net.state_dict(), reference_weights(0.1))
    print(f"max |horovod fp16 - torch| = {difference:.2e}")
    assert 0 < difference <= 1e-4


class Threads(easyfit.callbacks.Callback):
    """The torch threads rank 0 trains with (its attributes come back to the caller)."""

    def on_train_begin(self, logs=None):
        self.threads = torch.get_num_threads()


@pytest.mark.skipif(available_cores() < 2, reason="needs 2 cores to share")
def test_ranks_on_the_cpu_train_with_their_share_of_the_cores(all_cores, monkeypatch, capfd):
    import cloudpickle
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    threads = Threads()
    try:
        easyfit.Model(make_net(), "cross_entropy", "sgd").fit(*make_data(), epochs=1, batch_size=16, verbose=2,
                                                              callbacks=[threads], devices=2, accelerator="cpu",
                                                              strategy="horovod")
    finally:
        cloudpickle.unregister_pickle_by_value(sys.modules[__name__])
    share = max(1, available_cores() // 2)
    assert threads.threads == share
    assert f"{share} CPU thread{'s' if share > 1 else ''} per process ({available_cores()} cores / 2 processes" \
        in capfd.readouterr().out
