"""Learning-rate scaling by the effective batch size: rules, restore after fit, warmup, the summary words."""
from __future__ import annotations

import math

import pytest
import torch

import easyfit
from easyfit.distributed.strategies.ddp import DDPStrategy
from easyfit.parts.lr_scaling import Warmup, describe, lr_multiplier, scaled_learning_rates


def _optimizer(*lrs: float) -> torch.optim.Optimizer:
    groups = [{"params": [torch.nn.Parameter(torch.zeros(1))], "lr": lr} for lr in lrs]
    return torch.optim.SGD(groups)


@pytest.mark.parametrize("rule, factor, expected", [
    ("linear", 4, 4.0), ("sqrt", 4, 2.0), (None, 4, 1.0), ("none", 8, 1.0), ("linear", 1, 1.0)])
def test_rules(rule, factor, expected):
    assert lr_multiplier(rule, factor) == expected


def test_unknown_rule_is_an_error_naming_the_valid_ones():
    with pytest.raises(ValueError, match="'linear', 'sqrt' or None"):
        lr_multiplier("quadratic", 2)


def test_every_group_and_the_scheduler_are_scaled_then_restored():
    optimizer = _optimizer(0.1, 0.01)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=10)
    with scaled_learning_rates(optimizer, scheduler, 2.0):
        assert [g["lr"] for g in optimizer.param_groups] == pytest.approx([0.2, 0.02])
        assert scheduler.base_lrs == pytest.approx([0.2, 0.02])
    assert [g["lr"] for g in optimizer.param_groups] == pytest.approx([0.1, 0.01])
    assert scheduler.base_lrs == pytest.approx([0.1, 0.01])


def test_warmup_ramps_linearly_from_the_base_to_the_scaled_lr():
    optimizer = _optimizer(0.4)       # already scaled: base 0.1 × 4
    seen = _rates_taken(optimizer, Warmup(optimizer, multiplier=4.0, steps=3), 5)
    assert seen == pytest.approx([0.1, 0.2, 0.3, 0.4, 0.4])
    assert optimizer.param_groups[0]["lr"] == 0.4


def test_a_per_step_schedule_runs_its_own_course_under_the_warmup():
    """The ramp multiplies the LR the schedule gives each step; the schedule never sees the ramped LR (a chained
    ExponentialLR would otherwise decay the ramped value)."""
    optimizer = _optimizer(0.4)
    scheduler = torch.optim.lr_scheduler.ExponentialLR(optimizer, gamma=0.5)
    seen = _rates_taken(optimizer, Warmup(optimizer, multiplier=4.0, steps=4), 6, scheduler)
    factors = [0.25, 0.4375, 0.625, 0.8125, 1.0, 1.0]
    assert seen == pytest.approx([0.4 * 0.5 ** step * factor for step, factor in enumerate(factors)])


def _rates_taken(optimizer, warmup: Warmup, steps: int, scheduler=None) -> list[float]:
    """The LR of each optimizer step, as the training loop sets it: the warmup's ramp for the step, then a per-step
    schedule stepped."""
    taken = []
    for step in range(steps):
        warmup.apply(step)
        taken.append(optimizer.param_groups[0]["lr"])
        warmup.release()
        if scheduler is not None:
            scheduler.step()
    return taken


def test_an_epoch_schedule_keeps_its_decay_through_the_warmup():
    """StepLR halves the LR at the first epoch's end, when a one-epoch warmup ends: every step of epoch 2 takes the
    halved LR (the warmup's last step once set the LR back to its start, and the decay was lost for good)."""
    net = torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.08)
    taken = []
    optimizer.register_step_pre_hook(lambda opt, args, kwargs: taken.append(opt.param_groups[0]["lr"]))
    model = easyfit.Model(net, "cross_entropy", optimizer,
                          scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5))
    model.fit(torch.randn(32, 3), torch.randint(0, 2, (32,)), epochs=3, batch_size=8, verbose=0, devices=1,
              lr_warmup_epochs=1)
    assert taken == pytest.approx([0.08] * 4 + [0.04] * 4 + [0.02] * 4)


def test_a_resumed_warmup_continues_where_it_stood():
    optimizer = _optimizer(0.4)
    Warmup(optimizer, multiplier=4.0, steps=3, steps_done=1).apply(0)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.2)
    optimizer = _optimizer(0.4)
    Warmup(optimizer, multiplier=4.0, steps=3, steps_done=6).apply(0)   # resumed after the warmup: no ramp again
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.4)


def test_summary_line_says_what_was_done():
    strategy = DDPStrategy()
    strategy.configure(accelerator="cpu", parallel_devices=[torch.device("cpu")] * 2)
    optimizer = _optimizer(0.1)
    text = describe(16, strategy, "linear", optimizer, 2.0)
    assert text == "effective batch 32 = 16 × 2 processes; lr 0.05 → 0.1 (linear)"
    assert "not scaled" in describe(16, strategy, None, _optimizer(0.05), 1.0)


def test_one_process_fit_records_the_scaling_and_leaves_the_lr_alone():
    net = torch.nn.Linear(3, 2)
    model = easyfit.Model(net, "cross_entropy", torch.optim.SGD(net.parameters(), lr=0.05))
    history = model.fit(torch.randn(32, 3), torch.randint(0, 2, (32,)), epochs=1, batch_size=8, verbose=0,
                        lr_warmup_epochs=1)
    assert history.params["effective_batch_size"] == 8
    assert history.params["lr_multiplier"] == 1.0
    assert model.optimizer.param_groups[0]["lr"] == pytest.approx(0.05)


def test_resuming_with_another_scale_rescales_the_checkpoint_lrs(tmp_path):
    net = torch.nn.Linear(3, 2)
    model = easyfit.Model(net, "cross_entropy", torch.optim.SGD(net.parameters(), lr=0.05))
    model._lr_multiplier = 2.0        # as inside a 2-process fit with linear scaling
    model.optimizer.param_groups[0]["lr"] = 0.1
    model.save(tmp_path / "ckpt.pt")
    fresh = easyfit.Model(torch.nn.Linear(3, 2), "cross_entropy", "sgd")
    fresh.restore(torch.load(tmp_path / "ckpt.pt", weights_only=True))
    assert fresh.optimizer.param_groups[0]["lr"] == pytest.approx(0.05)
    assert math.isclose(fresh._lr_multiplier, 1.0)
