"""Checks that need no data run in the call's plan, in the caller, before any process starts: a 2-process fit is
refused with the plain error, raised from training/plan.py, never from a rank."""
from __future__ import annotations

import traceback

import pytest
import torch
from torch import nn

import easyfit

X, Y = torch.randn(16, 4), torch.randint(0, 3, (16,))


class LossInForward(nn.Module):
    """A net that returns its own loss when given the targets (loss="model")."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 3)

    def forward(self, x, labels=None):
        logits = self.linear(x)
        return logits if labels is None else nn.functional.cross_entropy(logits, labels)


def refusal(net, loss, **fit_options) -> tuple[str, list[str]]:
    """The message of the ValueError a 2-process ddp_spawn fit raises, and the modules its traceback went through."""
    model = easyfit.Model(net, loss, "sgd")
    with pytest.raises(ValueError) as error:
        model.fit(X, Y, batch_size=4, verbose=0, devices=2, accelerator="cpu", strategy="ddp_spawn", **fit_options)
    modules = [frame.filename.replace("\\", "/") for frame in traceback.extract_tb(error.value.__traceback__)]
    return str(error.value), modules


@pytest.mark.parametrize("loss, fit_options, words", [
    ("cross_entropy", {"validation_split": 0.25, "validation_data": (X, Y)},
     "either validation_data or validation_split"),
    ("cross_entropy", {"sample_weight": torch.ones(16), "class_weight": {0: 1.0, 1: 2.0, 2: 1.0}},
     "pass sample_weight or class_weight, not both"),
    ("model", {"sample_weight": torch.ones(16)}, "loss='model' trains on the one loss the net returns"),
    ("model", {"class_weight": {0: 1.0, 1: 2.0, 2: 1.0}}, "loss='model' trains on the one loss the net returns"),
    ("model", {"validation_data": (X, Y, torch.ones(16))}, "loss='model' trains on the one loss the net returns"),
    ("cross_entropy", {"steps_per_execution": 4, "compile": True},
     "steps_per_execution=4 needs the whole step as one program, but strategy 'ddp_spawn' trains on 2 processes"),
])
def test_a_check_that_needs_no_data_is_made_by_the_plan_before_any_process_starts(loss, fit_options, words):
    message, modules = refusal(LossInForward(), loss, **fit_options)
    assert words in message
    assert any(path.endswith("easyfit/training/plan.py") for path in modules), modules
    assert not any(path.endswith("easyfit/training/on_rank.py") for path in modules), modules


@pytest.mark.parametrize("strategy, precision, words, package", [
    ("deepspeed_stage_2", "64", "DeepSpeed trains in precision '32', '16-mixed' or 'bf16-mixed', not '64'",
     "deepspeed"),
    ("ddp_sharded_spawn", "16-mixed", "strategy='ddp_sharded_spawn' does not support precision='16-mixed'",
     "fairscale"),
])
def test_a_precision_the_backend_cannot_train_in_is_refused_by_the_plan(strategy, precision, words, package):
    pytest.importorskip(package, reason=f"{package} is not installed (pip install easyfit[{package}])")
    model = easyfit.Model(nn.Linear(4, 3), "cross_entropy", "sgd")
    with pytest.raises(ValueError, match=words.replace("(", r"\(").replace(")", r"\)")) as error:
        model.fit(X, Y, batch_size=4, verbose=0, devices=2, accelerator="cpu", strategy=strategy, precision=precision)
    modules = [frame.filename.replace("\\", "/") for frame in traceback.extract_tb(error.value.__traceback__)]
    assert any(path.endswith("easyfit/training/plan.py") for path in modules), modules


def test_compile_is_read_once_a_call_by_the_plan(monkeypatch):
    from easyfit.compiled import settings
    calls = []
    parse = settings.compile_settings
    monkeypatch.setattr(settings, "compile_settings", lambda value: calls.append(value) or parse(value))
    easyfit.Model(nn.Linear(4, 3), "cross_entropy", "sgd").fit(X, Y, batch_size=4, verbose=0,
                                                               compile={"backend": "eager"})
    assert calls == [{"backend": "eager"}]
