"""Scale the learning rate by the effective batch size (linear or square-root rule), with optional warmup."""
from __future__ import annotations

import contextlib
import math

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
    """Multiply every param group's LR (and the scheduler's base LRs, which it computes from) by `ratio`."""
    if ratio == 1.0:
        return
    for group in optimizer.param_groups:
        group["lr"] *= ratio
        if "initial_lr" in group:
            group["initial_lr"] *= ratio
    if scheduler is not None and hasattr(scheduler, "base_lrs"):
        scheduler.base_lrs = [lr * ratio for lr in scheduler.base_lrs]


@contextlib.contextmanager
def scaled_learning_rates(optimizer: torch.optim.Optimizer, scheduler, multiplier: float):
    """Scale the LRs for the duration of a fit and restore the user's scale after,
    so that calling fit again does not scale twice."""
    rescale_learning_rates(optimizer, scheduler, multiplier)
    try:
        yield
    finally:
        rescale_learning_rates(optimizer, scheduler, 1.0 / multiplier)


class Warmup:
    """Ramp the LR linearly from lr / multiplier to lr over the first `steps` optimizer steps (Goyal et al.,
    2017), on top of whatever each group holds: for the step, the group's LR (a schedule's or a callback's) times the
    ramp's factor, given back after it (`release`), so a schedule keeps its own course through the warmup. A resumed
    fit passes the optimizer steps already done in `steps_done`."""

    def __init__(self, optimizer: torch.optim.Optimizer, multiplier: float, steps: int, steps_done: int = 0):
        self.optimizer, self.steps, self.steps_done = optimizer, steps, steps_done
        self.start = 1.0 / multiplier   # the ramp's factor at the first step
        self.held: list[float] | None = None   # the groups' own LRs while a step runs with the ramp's

    def apply(self, step: int) -> None:
        """Set the LRs for this fit's optimizer step `step` (0-based); after the warmup this does nothing."""
        step += self.steps_done
        if step >= self.steps:
            return
        factor = self.start + (1.0 - self.start) * step / self.steps
        self.held = [group["lr"] for group in self.optimizer.param_groups]
        for group, lr in zip(self.optimizer.param_groups, self.held):
            group["lr"] = lr * factor

    def release(self) -> None:
        """Give the groups their own LRs back after the step."""
        if self.held is not None:
            for group, lr in zip(self.optimizer.param_groups, self.held):
                group["lr"] = lr
            self.held = None


def describe(batch_size: int, strategy, rule, optimizer: torch.optim.Optimizer, multiplier: float) -> str:
    """'effective batch 32 = 16 × 2 processes; lr 0.05 → 0.1 (linear)'."""
    factor = strategy.batch_factor
    text = f"effective batch {batch_size * factor} = {batch_size} × {factor} {strategy.describe_batch_factor()}"
    for note in (strategy.selection_note, strategy.auto_reason):
        if note:
            text = f"{note}; {text}"
    for setup in (strategy.describe_setup(), strategy.threads_note):
        if setup:
            text = f"{text}; {setup}"
    lrs = [group["lr"] for group in optimizer.param_groups]
    if multiplier == 1.0:
        return f"{text}; lr {describe_lrs(lrs)} (not scaled)"
    return f"{text}; lr {describe_lrs([lr / multiplier for lr in lrs])} → {describe_lrs(lrs)} ({rule})"


def describe_lrs(lrs: list[float]) -> str:
    """'0.05, 0.1': the distinct learning rates, in order."""
    return ", ".join(f"{lr:.4g}" for lr in sorted(set(lrs)))
