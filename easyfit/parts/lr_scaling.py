"""Scale the learning rate by the effective batch size (linear or square-root rule), with optional warmup."""
from __future__ import annotations

import functools
import math
import weakref

import torch

RULES = ("linear", "sqrt")


def lr_multiplier(rule: str | None, batch_factor: int) -> float:
    """How much larger the LR becomes when each step sees `batch_factor` times the per-process batch."""
    if rule is None or rule is False or str(rule).lower() in ("none", "off"):
        return 1.0
    if rule == "linear":
        return float(batch_factor)
    if rule == "sqrt":
        return math.sqrt(batch_factor)
    raise ValueError(f"lr_scaling must be 'linear', 'sqrt' or None; got {rule!r}")


def rescale_learning_rates(optimizer: torch.optim.Optimizer, scheduler, ratio: float) -> None:
    """Multiply every param group's LR (and the scheduler's base LRs, which it computes from) by `ratio`: how a
    checkpoint written before the scale was kept out of the optimizer is brought to the schedule's own rates."""
    if ratio == 1.0:
        return
    for group in optimizer.param_groups:
        group["lr"] *= ratio
        if "initial_lr" in group:
            group["initial_lr"] *= ratio
    if scheduler is not None and hasattr(scheduler, "base_lrs"):
        scheduler.base_lrs = [lr * ratio for lr in scheduler.base_lrs]


class StepRates:
    """The LR each optimizer step takes: each group's own (the one a schedule, a callback or the user set) times
    the fit's `multiplier`, ramped up from 1 over the first `warmup_steps` steps (Goyal et al., 2017). It is set
    just before the step (`apply`) and the group's own LR given back just after it (`release`), so schedulers,
    callbacks and checkpoints only ever see the schedule's own rates. A resumed fit passes the optimizer steps
    already done in `steps_done`."""

    def __init__(self, optimizer: torch.optim.Optimizer, multiplier: float, warmup_steps: int = 0,
                 steps_done: int = 0):
        self.optimizer, self.multiplier = optimizer, multiplier
        self.warmup_steps, self.steps_done = warmup_steps, steps_done
        self.held: list | None = None   # the groups' own LRs while a step runs with the scaled ones

    def factor(self, step: int) -> float:
        """What this fit's optimizer step `step` (0-based) multiplies the groups' LRs by."""
        step += self.steps_done
        if step >= self.warmup_steps:
            return self.multiplier
        return 1.0 + (self.multiplier - 1.0) * step / self.warmup_steps

    def apply(self, step: int) -> None:
        """Set the LRs for this fit's optimizer step `step` (0-based)."""
        factor = self.factor(step)
        if factor == 1.0:
            return
        self.held = [group["lr"] for group in self.optimizer.param_groups]
        for group, lr in zip(self.optimizer.param_groups, self.held):
            group["lr"] = lr * factor

    def release(self) -> None:
        """Give the groups their own LRs back after the step."""
        if self.held is not None:
            for group, lr in zip(self.optimizer.param_groups, self.held):
                group["lr"] = lr
            self.held = None


def track_optimizer_steps(scheduler) -> None:
    """Let an LR scheduler see its optimizer step again, as torch's LRScheduler does when it is built: it wraps the
    optimizer's `step` to record each call, and warns that "optimizer.step() has been overridden" when the wrapper is
    missing. It is, on an optimizer a sharded strategy built or a spawned rank unpickled (a pickle keeps no
    wrapper)."""
    optimizer = getattr(scheduler, "optimizer", None)
    step = getattr(getattr(optimizer, "step", None), "__func__", None)   # a bound method, as torch wraps
    if step is None or hasattr(optimizer.step, "_wrapped_by_lr_sched"):
        return
    owner = weakref.ref(optimizer)

    @functools.wraps(step)
    def wrapper(*args, **kwargs):
        stepped = owner()
        stepped._opt_called = True
        return step.__get__(stepped, type(stepped))(*args, **kwargs)

    wrapper._wrapped_by_lr_sched = True
    optimizer.step = wrapper


def effective_batch(batch_size: int, batch_factor: int, accumulate: int = 1) -> int:
    """The samples of one optimizer step: the per-process batch × the strategy's `batch_factor` × the accumulated
    batches."""
    return batch_size * batch_factor * accumulate


def describe(batch_size: int, strategy, rule, optimizer: torch.optim.Optimizer, multiplier: float,
             accumulate: int = 1, fit=None) -> str:
    """'effective batch 32 = 16 × 2 processes; lr 0.05 → 0.1 (linear)' (with accumulation: 'effective batch 64 =
    16 × 2 processes × 2 accumulated batches; ...'), with what the strategy's setup chose for `fit`. The LR's factor
    is the processes' alone (`lr_multiplier`)."""
    factor = strategy.batch_factor
    text = f"effective batch {effective_batch(batch_size, factor, accumulate)} = {batch_size} × {factor} " \
           f"{strategy.describe_batch_factor()}"
    if accumulate > 1:
        text = f"{text} × {accumulate} accumulated batches"
    for note in (strategy.selection_note, strategy.auto_reason):
        if note:
            text = f"{note}; {text}"
    for setup in (strategy.describe_setup(fit), fit and fit.call and fit.call.threads_note):
        if setup:
            text = f"{text}; {setup}"
    lrs = [group["lr"] for group in optimizer.param_groups]
    if multiplier == 1.0:
        return f"{text}; lr {describe_lrs(lrs)} (not scaled)"
    return f"{text}; lr {describe_lrs(lrs)} → {describe_lrs([lr * multiplier for lr in lrs])} ({rule})"


def describe_lrs(lrs: list[float]) -> str:
    """'0.05, 0.1': the distinct learning rates, in order."""
    return ", ".join(f"{lr:.4g}" for lr in sorted(set(lrs)))
