"""Hugging Face transformers models (built from small configs) on `datasets.Dataset`s, trained by one fit with
loss="model": equal to a plain PyTorch loop on the same batches in one process, and on 2 CPU processes under ddp,
FSDP2 and DeepSpeed ZeRO-3 (each on the combined batch), with exact evaluation and predict in order. The
multi-process fits run one after the other in one launch that the tests share."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hf_common import LR, columns, dataset, make_net, plain_loop

import easyfit

try:   # an install whose compiled parts do not load here skips as a missing one does
    import datasets  # noqa: F401
    import transformers  # noqa: F401
except Exception as error:
    pytest.skip(f"transformers / datasets unavailable: {error}", allow_module_level=True)

SCRIPT = Path(__file__).parent / "hf_train.py"


def assert_same(losses: list[float], weights: dict, expected: tuple[list[float], dict], atol: float = 1e-5) -> None:
    assert losses == pytest.approx(expected[0], abs=atol)
    for name, value in expected[1].items():
        difference = (weights[name] - value).abs().max().item()
        assert difference <= atol, f"{name} differs by {difference}"


@pytest.mark.timeout(200)
@pytest.mark.parametrize("case", ["bert", "gpt2"])
def test_one_fit_trains_what_a_plain_loop_trains(case):
    net = make_net(case)
    model = easyfit.Model(net, "model", "sgd", lr=LR)
    history = model.fit(dataset(case), batch_size=16, epochs=2, shuffle=False, verbose=0)
    assert_same(history.history["loss"], net.state_dict(), plain_loop(case, 16))
    with torch.no_grad():
        expected = net(**{key: value for key, value in columns(case).items() if key not in ("label", "labels")})
    torch.testing.assert_close(model.predict(dataset(case), batch_size=16), expected.logits)   # the logits


@pytest.mark.timeout(200)
def test_a_loss_by_name_and_metrics_take_the_classifier_s_logits():
    net = make_net("bert")
    model = easyfit.Model(net, "cross_entropy", "sgd", lr=LR, metrics=["accuracy"])
    history = model.fit(dataset("bert"), batch_size=16, epochs=2, shuffle=False, verbose=0)
    assert_same(history.history["loss"], net.state_dict(), plain_loop("bert", 16))
    with torch.no_grad():
        logits = net(**{key: value for key, value in columns("bert").items() if key != "label"}).logits
    accuracy = model.evaluate(dataset("bert"), verbose=0, return_dict=True)["accuracy"]
    assert accuracy == pytest.approx(float((logits.argmax(1) == columns("bert")["label"]).float().mean()))


def deepspeed_loads() -> bool:
    """A DeepSpeed whose ops do not load here is skipped as a missing one."""
    try:
        import deepspeed  # noqa: F401
    except Exception:
        return False
    return True


#: every fit of the one launch the tests share, (strategy, case); and ("deepspeed_stage_3", "bert") where it loads
RUNS = [("ddp", "bert"), ("ddp", "gpt2"), ("ddp", "stream"), ("fsdp", "bert")]


def assert_exact_evaluation(case: str, outcome: dict) -> None:
    """evaluate and predict on 2 processes give one process's numbers on the same trained weights."""
    net = make_net(case)
    net.load_state_dict(outcome["state"])
    model = easyfit.Model(net, "model", "sgd", metrics=["accuracy"] if case == "bert" else None)
    scores = model.evaluate(dataset(case), batch_size=8, verbose=0, return_dict=True)
    assert outcome["scores"] == pytest.approx(scores, abs=1e-5)
    torch.testing.assert_close(outcome["predictions"], model.predict(dataset(case), batch_size=8), atol=1e-5, rtol=0)


@pytest.fixture(scope="module")
def launch(tmp_path_factory) -> tuple[Path, dict]:
    """(OUT, {(strategy, case): outcome}) of one launch of every fit of RUNS (and DeepSpeed's) on 2 processes, one
    after the other."""
    out = tmp_path_factory.mktemp("hf")
    runs = RUNS + ([("deepspeed_stage_3", "bert")] if deepspeed_loads() else [])
    environment = {**os.environ, "OMP_NUM_THREADS": "1"}
    process = subprocess.run([sys.executable, str(SCRIPT), str(out), ",".join(":".join(run) for run in runs)],
                             env=environment, capture_output=True, text=True, timeout=400)
    assert process.returncode == 0, process.stderr[-4000:]
    return out, torch.load(out / "result.pt", weights_only=False)


@pytest.mark.timeout(420)
def test_ddp_on_two_processes_trains_the_combined_batch_and_evaluates_exactly(launch):
    for case in ("bert", "gpt2"):
        outcome = launch[1]["ddp", case]
        assert outcome["world_size"] == 2
        assert_same(outcome["history"]["loss"], outcome["state"], plain_loop(case, 16))
        assert_exact_evaluation(case, outcome)


@pytest.mark.timeout(420)
@pytest.mark.parametrize("strategy", ["fsdp", "deepspeed_stage_3"])
def test_the_model_s_own_loss_under_sharded_strategies(strategy, launch):
    if (strategy, "bert") not in launch[1]:
        pytest.skip("deepspeed is not installed here, or its ops do not load")
    outcome = launch[1][strategy, "bert"]
    assert_same(outcome["history"]["loss"], outcome["state"], plain_loop("bert", 16))
    assert_exact_evaluation("bert", outcome)


@pytest.mark.timeout(420)
def test_an_iterable_hugging_face_dataset_is_split_between_the_processes(launch):
    """Its 2 shards (the first and the second half of the rows) go one to each process: each trains 4 batches of 8
    per epoch, and a step's combined batch is 8 rows of each half."""
    out, results = launch
    outcome = results["ddp", "stream"]
    assert [(out / f"stream-{rank}.txt").read_text() for rank in (0, 1)] == ["8", "8"]
    order = torch.stack([torch.arange(32).view(4, 8), torch.arange(32, 64).view(4, 8)], 1).flatten()
    assert_same(outcome["history"]["loss"], outcome["state"], plain_loop("bert", 16, order=order))
