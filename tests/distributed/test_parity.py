"""Each strategy on 2 CPU processes (gloo) trains exactly what plain PyTorch trains on the combined batch."""
from __future__ import annotations

import pytest
import torch
from runner import (
    assert_exact_evaluation,
    assert_same_weights,
    launch_once,
    make_data,
    make_net,
    reference_weights,
    result,
    run_script,
)

import easyfit

pytestmark = pytest.mark.timeout(240)


def _single_process_scores() -> tuple[dict, torch.Tensor]:
    x, y = make_data()
    model = easyfit.Model(make_net(), "cross_entropy", "sgd", metrics=["accuracy"])
    return (model.evaluate(x[:101], y[:101], batch_size=8, verbose=0, return_dict=True),
            model.predict(x[:101], batch_size=8))


def _check_run(process, out, lr_expected: float) -> dict:
    assert process.returncode == 0, process.stderr[-4000:]
    outcome = result(out)
    assert outcome["world_size"] == 2
    assert_same_weights(outcome["state"], reference_weights(lr_expected))
    return outcome


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """launched(strategy) -> (OUT, result.pt) of one launch per strategy, shared by the tests: lr 0.1 without LR
    scaling, then a new Model at lr 0.05 with linear scaling (as a script that trains a second model does)."""
    def launch(out, strategy: str) -> dict:
        process = run_script(out, strategy, "--lr", "0.1", "--lr-scaling", "none", "--then-linear", "0.05")
        return _check_run(process, out, lr_expected=0.1)
    return launch_once(tmp_path_factory, launch)


@pytest.mark.parametrize("strategy", ["ddp", "ddp_spawn", "ddp_fork"])
def test_two_processes_match_plain_pytorch_on_the_combined_batch(strategy, launched):
    tmp_path, outcome = launched(strategy)
    # the caller's net holds the trained weights and the caller gets the History, whatever the launcher
    assert len(outcome["history"]["loss"]) == 2
    assert outcome["params"]["effective_batch_size"] == 32
    # evaluation is exact: the same numbers as one process on the same (trained) weights
    expected = assert_exact_evaluation(outcome)
    assert outcome["local_scores"]["accuracy"] == pytest.approx(expected["accuracy"], abs=1e-6)
    restored = easyfit.Model.load(tmp_path / "checkpoint.pt", net=make_net())
    assert_same_weights(restored.net.state_dict(), outcome["state"], atol=0)


@pytest.mark.parametrize("strategy", ["ddp", "ddp_spawn", "ddp_fork"])
def test_linear_lr_scaling_matches_one_process_with_the_scaled_lr(strategy, launched):
    outcome = launched(strategy)[1]["linear"]
    assert_same_weights(outcome["state"], reference_weights(0.1))
    assert outcome["params"]["lr_multiplier"] == 2.0
    assert "effective batch 32 = 16 × 2 processes; lr 0.05 → 0.1 (linear)" in outcome["params"]["summary"]
    assert outcome["lr_after"] == [pytest.approx(0.05)], "the user's LR is restored after fit"


def test_ddp2_two_nodes_on_localhost_match_plain_pytorch(tmp_path):
    """One launch of two nodes of one process each: lr 0.1 without LR scaling, then a new Model at lr 0.05 with
    linear scaling; both train as one process at lr 0.1 on the combined batch."""
    from runner import finished_together, start_script

    from easyfit.distributed.environments import find_free_port
    port = str(find_free_port())
    nodes = [start_script(tmp_path, "ddp2", "--num-nodes", "2", "--devices", "1", "--lr", "0.1", "--lr-scaling", "none",
                          "--then-linear", "0.05",
                          env={"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "NODE_RANK": str(rank)})
             for rank in range(2)]
    ends = finished_together(nodes, timeout=180)
    assert [end.returncode for end in ends] == [0, 0], ends[0].stderr[-3000:] + ends[1].stderr[-3000:]
    found = result(tmp_path)
    for outcome in (found, found["linear"]):
        assert outcome["params"]["world_size"] == 2
        assert outcome["params"]["batch_factor"] == 2
        assert outcome["params"]["effective_batch_size"] == 32
        assert_same_weights(outcome["state"], reference_weights(0.1))
    assert found["linear"]["params"]["lr_multiplier"] == 2.0
