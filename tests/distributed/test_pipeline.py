"""The pipeline strategy on 2 and 4 CPU processes (gloo): it trains what plain PyTorch trains on the combined batch,
evaluates exactly, saves one file a plain nn.Sequential loads, resumes onto another number of stages, and refuses
what it cannot do before any work. Each launch runs many checks (tests/distributed/scripts/pipeline.py)."""
from __future__ import annotations

import pytest
import torch
from runner import run_script
from torch import nn

import easyfit
from easyfit.distributed.strategy_parts.pipeline_engine import parts
from easyfit.distributed.strategy_parts.pipeline_split import CheckpointedStage, auto_balance, layers_of
from easyfit.strategies import Pipeline

pytestmark = pytest.mark.timeout(300)

from common import make_data, make_pipeline_net  # the scripts' folder, put on the path by runner

WITH_ACCUMULATION = {"accumulate": 2, "clip": 0.5}
PARITY = {"gpipe_2_2": WITH_ACCUMULATION, "gpipe_auto": WITH_ACCUMULATION, "1f1b_2_2": WITH_ACCUMULATION,
          "1f1b_auto": WITH_ACCUMULATION, "1f1b_plain": {}, "interleaved_auto": WITH_ACCUMULATION}


def reference(epochs: int = 2, window: int = 20, accumulate: int = 1, clip: float | None = None) -> dict:
    """Plain PyTorch, one process, Adam on batches of `window` samples in order."""
    x, y = make_data()
    net = make_pipeline_net()
    optimizer = torch.optim.Adam(net.parameters(), lr=0.01)
    batches = [(x[start:start + window], y[start:start + window]) for start in range(0, len(x), window)]
    for _ in range(epochs):
        for step, (inputs, target) in enumerate(batches):
            if step % accumulate == 0:
                optimizer.zero_grad()
            (nn.functional.cross_entropy(net(inputs), target) / accumulate).backward()
            if (step + 1) % accumulate == 0 or step + 1 == len(batches):
                if clip is not None:
                    torch.nn.utils.clip_grad_norm_(net.parameters(), clip)
                optimizer.step()
    return net.state_dict()


def max_difference(actual: dict, expected: dict) -> float:
    return max((actual[name] - value).abs().max().item() for name, value in expected.items())


def run(tmp_path, checks: str, devices: int) -> list[dict]:
    process = run_script(tmp_path, checks, "--devices", str(devices), script="pipeline.py", timeout=240)
    assert process.returncode == 0, process.stderr[-6000:]
    return [torch.load(tmp_path / f"{rank}.pt", weights_only=False) for rank in range(devices)]


def check_evaluation(outcome: list[dict], check: str) -> dict:
    """Every rank's evaluate and predict (101 samples, batches of 8) equal one process's on the same weights."""
    x, y = make_data()
    net = make_pipeline_net()
    net.load_state_dict(outcome[0][check]["weights"])
    single = easyfit.Model(net, "cross_entropy", "adam", metrics=["accuracy"])
    expected = single.evaluate(x[:101], y[:101], batch_size=8, verbose=0, return_dict=True)
    for found in outcome:
        scores = found[check]["scores"]
        assert scores["loss"] == pytest.approx(expected["loss"], abs=1e-6)
        assert scores["accuracy"] == pytest.approx(expected["accuracy"], abs=1e-6)
        torch.testing.assert_close(found[check]["predictions"], single.predict(x[:101], batch_size=8))
    return expected


def test_two_stages_train_evaluate_save_and_resume_as_plain_pytorch(tmp_path):
    outcome = run(tmp_path, "parity,evaluate,groups,resume", devices=2)
    for case, options in PARITY.items():   # every batch of 20 in 3 micro-batches leaves a rest of 2
        expected = reference(**options)
        for rank in (0, 1):   # every rank holds the whole trained net after fit
            difference = max_difference(outcome[rank]["parity"][case], expected)
            print(f"parity {case:18s} rank {rank}: max weight difference {difference:.2e}")
            assert difference <= 1e-5, f"{case} differs from plain PyTorch by {difference}"
    assert max_difference(reference(**WITH_ACCUMULATION), reference()) > 1e-3   # the options matter

    for rank in (0, 1):   # a stage without parameters; an optimizer's param groups split between the stages
        assert outcome[rank]["groups"] <= 1e-5

    expected = check_evaluation(outcome, "evaluate")
    found = outcome[0]["evaluate"]
    assert found["val_loss"] == pytest.approx(expected["loss"], abs=1e-6)
    assert found["val_accuracy"] == pytest.approx(expected["accuracy"], abs=1e-6)

    resumed = outcome[0]["resume"]   # 2 epochs on 2 stages, then 2 more on 1 stage x 2 replicas
    difference = max_difference(resumed["resumed"], resumed["straight"])
    print(f"resume onto another number of stages: max weight difference {difference:.2e}")
    assert difference <= 1e-5
    plain = make_pipeline_net()   # a checkpoint written during fit is one plain state dict
    plain.load_state_dict(torch.load(resumed["checkpoint"], weights_only=True)["net"])
    restored = easyfit.Model.load(resumed["saved"], net=make_pipeline_net())
    torch.testing.assert_close(restored.net.state_dict(), resumed["weights"], rtol=0, atol=0)
    assert len(restored.optimizer.state_dict()["state"]) == 6   # Adam's state of every stage's parameters


def test_two_stages_by_two_replicas_train_evaluate_and_resume_onto_four_stages_as_plain_pytorch(tmp_path):
    outcome = run(tmp_path, "mesh", devices=4)
    expected = reference(epochs=2, window=20)   # 2 replicas x batch 10: the combined batch is 20
    for rank in range(4):
        assert max_difference(outcome[rank]["mesh"]["weights"], expected) <= 1e-5
        assert max_difference(outcome[rank]["mesh"]["resumed"], expected) <= 1e-5
    check_evaluation(outcome, "mesh")   # each replica's last stage holds half the outputs


# --- before any work ------------------------------------------------------------------------------
def fit(net, strategy, devices: int = 2):
    x, y = make_data()
    easyfit.Model(net, "cross_entropy", "sgd").fit(x, y, epochs=1, verbose=0, devices=devices, accelerator="cpu",
                                                   strategy=strategy)


@pytest.mark.parametrize("net, strategy, message", [
    (nn.Linear(6, 3), "pipeline", "nn.Sequential"),
    (make_pipeline_net(), Pipeline(balance=[1, 2]), "places 3 layers, but the nn.Sequential has 4"),
    (make_pipeline_net(), Pipeline(balance=[2, 2], stages=1), "has 2 entries, but the pipeline has 1 stages"),
    (nn.Sequential(nn.Linear(6, 3)), "pipeline", "2 stages but the nn.Sequential has only 1 layers"),
    (make_pipeline_net(), Pipeline(stages=3), "stages=3 needs at least 3 processes"),
    (make_pipeline_net(), Pipeline(schedule="1f1b", microbatches=1), "at least as many micro-batches"),
])
def test_what_the_pipeline_cannot_train_is_refused_before_any_process_starts(net, strategy, message):
    with pytest.raises((TypeError, ValueError), match=message):
        fit(net, strategy)


def test_the_model_s_own_loss_is_refused_before_any_process_starts():
    """A stage's forward takes the previous stage's output alone: it cannot take the targets as labels=."""
    x, y = make_data()
    model = easyfit.Model(make_pipeline_net(), "model", "sgd")
    with pytest.raises(ValueError, match="loss='model' passes the targets into the net's forward.*'pipeline'"):
        model.fit(x, y, epochs=1, verbose=0, devices=2, accelerator="cpu", strategy="pipeline")


def test_data_the_first_stage_cannot_take_is_explained():
    x, y = make_data()
    with pytest.raises(ValueError, match="expects 6 features per sample, but the data has 5"):
        easyfit.Model(make_pipeline_net(), "cross_entropy", "sgd").fit(
            x[:, :5], y, epochs=1, verbose=0, devices=1, accelerator="cpu", strategy="pipeline")


@pytest.mark.parametrize("options, message", [
    ({"schedule": "zigzag"}, "unknown pipeline schedule 'zigzag'"),
    ({"checkpoint": "sometimes"}, "checkpoint must be one of never, except_last, always"),
    ({"balance": [2, 0]}, "balance must be 'auto' or a list"),
    ({"microbatches": 0}, "microbatches must be a positive int"),
    ({"chunks": 2}, "chunks .* applies to schedule='interleaved_1f1b'"),
])
def test_bad_options_are_refused_when_the_strategy_is_made(options, message):
    with pytest.raises(ValueError, match=message):
        Pipeline(**options)


def test_loss_scaled_half_precision_is_refused_before_any_process_starts():
    x, y = make_data()
    with pytest.raises(ValueError, match="Use precision='bf16-mixed'"):
        easyfit.Model(make_pipeline_net(), "cross_entropy", "sgd").fit(
            x, y, epochs=1, verbose=0, devices=2, accelerator="cpu", strategy="pipeline", precision="16-mixed")


# --- the parts, alone ------------------------------------------------------------------------------
def test_auto_balance_gives_each_stage_a_near_equal_share_of_the_parameters():
    blocks = [nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64), nn.Linear(64, 64)]
    assert auto_balance(layers_of(nn.Sequential(*blocks)), 2) == [3, 3]
    assert auto_balance(layers_of(nn.Sequential(*blocks)), 4) == [1, 2, 2, 1]   # a ReLU goes with the next layer
    assert auto_balance(layers_of(nn.Sequential(nn.ReLU(), nn.ReLU())), 2) == [1, 1]


def test_a_batch_runs_as_equal_micro_batches_plus_one_for_the_rest():
    assert parts(20, 4) == [(0, 20, 4)]
    assert parts(20, 3) == [(0, 18, 3), (18, 2, 1)]
    assert parts(2, 4) == [(0, 2, 1)]


@pytest.mark.parametrize("policy, checkpointed", [("never", 0), ("except_last", 2), ("always", 3)])
def test_activation_checkpointing_runs_per_micro_batch(monkeypatch, policy, checkpointed):
    import easyfit.distributed.strategy_parts.pipeline_split as split
    calls = []
    monkeypatch.setattr(split, "checkpoint", lambda function, *inputs, **options: calls.append(1) or function(*inputs))
    stage = CheckpointedStage(nn.Sequential(nn.Linear(2, 2)), policy)
    stage.start_step(3)
    for _ in range(3):
        stage(torch.ones(1, 2))
    assert len(calls) == checkpointed


@pytest.mark.gpu
def test_one_stage_on_a_gpu_trains_as_plain_pytorch():
    """Device discipline: everything the strategy creates lies on the strategy's device (a CUDA GPU here)."""
    x, y = make_data()
    net = make_pipeline_net()
    model = easyfit.Model(net, "cross_entropy", torch.optim.Adam(net.parameters(), lr=0.01), metrics=["accuracy"])
    model.fit(x, y, batch_size=20, epochs=2, shuffle=False, verbose=0, devices=1, accelerator="gpu",
              strategy=Pipeline(microbatches=3), validation_data=(x[:50], y[:50]))
    expected = reference()
    assert max_difference({k: v.cpu() for k, v in net.state_dict().items()}, expected) <= 1e-4
