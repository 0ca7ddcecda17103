"""Learning-rate scaling by the effective batch size: rules, restore after fit, warmup, the summary words."""
from __future__ import annotations

import math
import pickle
import warnings

import pytest
import torch

import easyfit
from easyfit.distributed.strategies.base import Strategy
from easyfit.distributed.strategies.ddp import DDPStrategy
from easyfit.parts.lr_scaling import StepRates, describe, lr_multiplier, track_optimizer_steps
from easyfit.training.running_call import RunningCall


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


def test_each_step_takes_every_groups_own_lr_scaled_and_gives_it_back():
    optimizer = _optimizer(0.1, 0.01)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=10)
    rates = StepRates(optimizer, 2.0)
    rates.apply(0)
    assert [g["lr"] for g in optimizer.param_groups] == pytest.approx([0.2, 0.02])
    rates.release()
    assert [g["lr"] for g in optimizer.param_groups] == [0.1, 0.01]
    assert scheduler.base_lrs == [0.1, 0.01], "the schedule never sees the scale"


def test_warmup_ramps_linearly_from_the_base_to_the_scaled_lr():
    optimizer = _optimizer(0.1)
    seen = _rates_taken(optimizer, StepRates(optimizer, multiplier=4.0, warmup_steps=3), 5)
    assert seen == pytest.approx([0.1, 0.2, 0.3, 0.4, 0.4])
    assert optimizer.param_groups[0]["lr"] == 0.1


def test_a_per_step_schedule_runs_its_own_course_under_the_warmup():
    """The ramp multiplies the LR the schedule gives each step; the schedule never sees the ramped LR (a chained
    ExponentialLR would otherwise decay the ramped value)."""
    optimizer = _optimizer(0.1)
    scheduler = torch.optim.lr_scheduler.ExponentialLR(optimizer, gamma=0.5)
    seen = _rates_taken(optimizer, StepRates(optimizer, multiplier=4.0, warmup_steps=4), 6, scheduler)
    factors = [1.0, 1.75, 2.5, 3.25, 4.0, 4.0]
    assert seen == pytest.approx([0.1 * 0.5 ** step * factor for step, factor in enumerate(factors)])


SCHEDULES = {
    "OneCycleLR": lambda opt: torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=8),
    "CyclicLR": lambda opt: torch.optim.lr_scheduler.CyclicLR(opt, 0.01, 0.1, step_size_up=2),
    "SequentialLR": lambda opt: torch.optim.lr_scheduler.SequentialLR(opt, [
        torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.25, total_iters=2),
        torch.optim.lr_scheduler.ExponentialLR(opt, 0.5)], milestones=[2]),
    "ChainedScheduler": lambda opt: torch.optim.lr_scheduler.ChainedScheduler([
        torch.optim.lr_scheduler.ExponentialLR(opt, 0.9), torch.optim.lr_scheduler.StepLR(opt, 2, 0.5)]),
}


@pytest.mark.parametrize("name", SCHEDULES)
def test_a_schedule_with_rates_of_its_own_is_scaled_at_every_step(name):
    """Each step takes the schedule's own rate times the scale, also where the schedule sets absolute rates
    (max_lr) or chains schedulers that hold rates of their own; the optimizer keeps the schedule's value."""
    plain = _optimizer(0.1)
    schedule = SCHEDULES[name](plain)
    expected = []
    for _ in range(6):
        expected.append(plain.param_groups[0]["lr"] * 2)
        plain.step()
        schedule.step()
    optimizer = _optimizer(0.1)
    seen = _rates_taken(optimizer, StepRates(optimizer, 2.0), 6, SCHEDULES[name](optimizer))
    assert seen == pytest.approx(expected, rel=1e-12)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(plain.param_groups[0]["lr"], rel=1e-12)


def _rates_taken(optimizer, rates: StepRates, steps: int, scheduler=None) -> list[float]:
    """The LR of each optimizer step, as the training loop sets it: the scale (and warmup) for the step, then a
    per-step schedule stepped."""
    taken = []
    for step in range(steps):
        rates.apply(step)
        taken.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        rates.release()
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
    optimizer = _optimizer(0.1)
    StepRates(optimizer, multiplier=4.0, warmup_steps=3, steps_done=1).apply(0)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.2)
    optimizer = _optimizer(0.1)
    StepRates(optimizer, multiplier=4.0, warmup_steps=3, steps_done=6).apply(0)   # after the warmup: no ramp again
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.4)


def test_summary_line_says_what_was_done():
    strategy = DDPStrategy()
    strategy.configure(accelerator="cpu", parallel_devices=[torch.device("cpu")] * 2)
    optimizer = _optimizer(0.05)
    text = describe(16, strategy, "linear", optimizer, 2.0)
    assert text == "effective batch 32 = 16 × 2 processes; lr 0.05 → 0.1 (linear)"
    assert "not scaled" in describe(16, strategy, None, _optimizer(0.05), 1.0)
    # accumulation counts in the effective batch; the LR's factor is the processes' alone (as documented)
    assert describe(16, strategy, "linear", _optimizer(0.05), lr_multiplier("linear", strategy.batch_factor), 2) == \
        "effective batch 64 = 16 × 2 processes × 2 accumulated batches; lr 0.05 → 0.1 (linear)"


def test_the_effective_batch_counts_the_accumulated_batches():
    """batch 8 with gradient_accumulation_steps=2: 16 samples per optimizer step, in the params and the summary."""
    net = torch.nn.Linear(3, 2)
    model = easyfit.Model(net, "cross_entropy", torch.optim.SGD(net.parameters(), lr=0.05))
    history = model.fit(torch.randn(32, 3), torch.randint(0, 2, (32,)), epochs=1, batch_size=8, verbose=0,
                        gradient_accumulation_steps=2)
    assert history.params["effective_batch_size"] == 16 and history.params["batch_factor"] == 1
    assert history.params["summary"].startswith("effective batch 16 = 8 × 1 process × 2 accumulated batches; ")


def test_one_process_fit_records_the_scaling_and_leaves_the_lr_alone():
    net = torch.nn.Linear(3, 2)
    model = easyfit.Model(net, "cross_entropy", torch.optim.SGD(net.parameters(), lr=0.05))
    history = model.fit(torch.randn(32, 3), torch.randint(0, 2, (32,)), epochs=1, batch_size=8, verbose=0,
                        lr_warmup_epochs=1)
    assert history.params["effective_batch_size"] == 8
    assert history.params["lr_multiplier"] == 1.0
    assert model.optimizer.param_groups[0]["lr"] == pytest.approx(0.05)


def test_a_checkpoint_holds_the_schedules_own_lrs(tmp_path):
    """Saved inside a scaled fit, the checkpoint holds the optimizer's own LRs; one written by an older easyfit,
    whose optimizer held the scaled LRs, loads at the schedule's own LRs too."""
    net = torch.nn.Linear(3, 2)
    model = easyfit.Model(net, "cross_entropy", torch.optim.SGD(net.parameters(), lr=0.05))
    model.running = RunningCall(Strategy(), model.precision, lr_multiplier=2.0)   # as inside a 2-process fit
    model.save(tmp_path / "ckpt.pt")
    state = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    assert state["optimizer"]["param_groups"][0]["lr"] == 0.05
    fresh = easyfit.Model(torch.nn.Linear(3, 2), "cross_entropy", "sgd")
    fresh.restore(state)
    assert fresh.optimizer.param_groups[0]["lr"] == 0.05
    assert math.isclose(fresh._lr_multiplier, 1.0)
    del state["unscaled_lrs"]
    state["optimizer"]["param_groups"][0]["lr"] = 0.1   # as an older easyfit saved it
    fresh.restore(state)
    assert fresh.optimizer.param_groups[0]["lr"] == pytest.approx(0.05)


@pytest.mark.parametrize("tracked", [False, True])
def test_a_scheduler_over_an_unpickled_optimizer_sees_it_step_again(tracked):
    """A spawned rank unpickles the optimizer without the wrapper torch's LRScheduler put on its `step`, and torch
    then warns that "optimizer.step() has been overridden" at the first scheduler step; fit puts the wrapper back
    (tracked=False shows the warning the fix removes)."""
    optimizer = _optimizer(0.1)
    scheduler = pickle.loads(pickle.dumps(torch.optim.lr_scheduler.StepLR(optimizer, 1)))
    if tracked:
        track_optimizer_steps(scheduler)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        scheduler.optimizer.step()
        scheduler.step()
    overridden = [w for w in caught if "overridden" in str(w.message)]
    assert bool(overridden) != tracked
    assert scheduler.optimizer.param_groups[0]["lr"] == pytest.approx(0.01)
