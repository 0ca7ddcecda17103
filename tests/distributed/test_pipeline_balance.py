"""Pipeline(balance=...) that needs more processes than the call runs names balance, the argument the user gave."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import easyfit
from easyfit.strategies import Pipeline


def fit(strategy, devices: int) -> None:
    net = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3))
    x, y = torch.randn(16, 6), torch.randint(0, 3, (16,))
    easyfit.Model(net, "cross_entropy", "sgd").fit(x, y, epochs=1, verbose=0, devices=devices, accelerator="cpu",
                                                   strategy=strategy)


@pytest.mark.parametrize("strategy, devices, message", [
    (Pipeline(balance=[2, 2, 1]), 2, r"balance=\[2, 2, 1\] \(3 stages, one process per stage\) needs at least 3 "
                                     r"processes, but the call runs 2: .* or a balance of at most 2 entries"),
    (Pipeline(balance=[2, 2, 1]), 4, r"3 processes per replica \(balance=\[2, 2, 1\] .*\), which does not divide "
                                     r"the 4"),
    (Pipeline(balance=[2, 1, 1, 1], schedule="interleaved_1f1b"), 1,
     r"balance=\[2, 1, 1, 1\] \(4 stages with 2 stages per rank \(chunks\), one process per rank\) needs at least 2"),
])
def test_a_balance_longer_than_the_processes_names_balance(strategy, devices, message):
    with pytest.raises(ValueError, match=message):
        fit(strategy, devices)


def test_stages_given_by_name_are_still_named():
    with pytest.raises(ValueError, match="stages=3 needs at least 3 processes, but the call runs 2: .* fewer stages"):
        fit(Pipeline(stages=3), 2)
