"""model.find_lr: the learning-rate range test.

A trial fit raises the learning rate exponentially from `start_lr` to `end_lr` over `num_steps` optimizer steps,
records the loss of every step smoothed by an exponential moving average, and stops early once that loss diverges.
The suggestion is the rate at which the smoothed loss falls fastest (per decade of learning rate) before its
minimum, at most a tenth of the rate at the minimum. Everything the trial changed is undone afterwards
(easyfit.tuning.trial).
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

import torch

from easyfit.callbacks.base import Callback, callback_list
from easyfit.tuning import SWEEP_OPTIONS
from easyfit.tuning.trial import undone_afterwards
from easyfit.utils.checks import check_positive_int, check_positive_number


@dataclass
class LRFinderResult:
    """`lrs` and their smoothed `losses` (the curve), and the `suggestion` (None when the curve is too short)."""
    lrs: list[float]
    losses: list[float]
    suggestion: float | None
    figure: object = field(default=None, repr=False)

    def plot(self, path: str | os.PathLike | None = None):
        """A matplotlib Figure of the smoothed loss against the learning rate (log scale), the suggestion marked;
        saved to `path` when given. Needs matplotlib: pip install easyfit[plot]."""
        from easyfit.utils.plotting import plot_lr_curve
        return plot_lr_curve(self, path)


class LRSweep(Callback):
    """Sets each step's learning rate and records the smoothed loss; stops when it diverges or the steps are done.

    The loss of each step is averaged over all processes, so every rank sees the same curve and stops at the same
    step. The rates recorded are those to pass as the Model's `lr`: fit's `lr_scaling` multiplies them as usual."""

    may_stop_training = False   # every rank decides alike, from the same averaged losses

    def __init__(self, start_lr: float, end_lr: float, num_steps: int, smoothing: float, divergence: float):
        self.start_lr, self.end_lr, self.num_steps = start_lr, end_lr, num_steps
        self.smoothing, self.divergence = smoothing, divergence
        self.lrs: list[float] = []
        self.losses: list[float] = []
        self.average = 0.0
        self.ratios: list[float] = []

    def on_train_begin(self, logs=None):
        groups = self.model.optimizer.param_groups
        self.ratios = [group["lr"] / groups[0]["lr"] if groups[0]["lr"] else 1.0 for group in groups]

    def lr_at(self, step: int) -> float:
        return self.start_lr * (self.end_lr / self.start_lr) ** (step / max(self.num_steps - 1, 1))

    def on_train_batch_begin(self, batch, logs=None):
        lr = self.lr_at(len(self.lrs))
        for group, ratio in zip(self.model.optimizer.param_groups, self.ratios):
            group["lr"] = lr * ratio   # each step takes it times fit's scale
        self.lrs.append(lr)

    def on_train_batch_end(self, batch, logs=None):
        strategy = self.model.strategy
        loss = float(strategy.reduce(torch.tensor([logs["batch_loss"]], dtype=torch.float64,
                                                  device=strategy.root_device), "mean"))
        beta = 1.0 - self.smoothing
        self.average = beta * self.average + (1.0 - beta) * loss
        smoothed = self.average / (1.0 - beta ** len(self.lrs))   # bias-corrected: the first values are not 0
        self.losses.append(smoothed)
        diverged = not math.isfinite(smoothed) or smoothed > self.divergence * min(self.losses)
        if diverged or len(self.lrs) >= self.num_steps:
            self.model.stop_training = True

    def state_dict(self) -> dict:   # how a curve recorded in a spawned rank 0 comes back to the caller
        return {"lrs": self.lrs, "losses": self.losses}

    def load_state_dict(self, state: dict) -> None:
        self.lrs, self.losses = list(state["lrs"]), list(state["losses"])


def suggest_lr(lrs: list[float], losses: list[float], skip_start: int = 5) -> float | None:
    """The rate where the smoothed loss falls fastest per decade before its minimum (skipping the first
    `skip_start` points, where the average has seen few steps), but at most a tenth of the rate of the lowest loss:
    the moving average lags the loss, which moves both points to higher rates. None with fewer than 3 points."""
    points = [(math.log10(lr), loss) for lr, loss in zip(lrs, losses) if math.isfinite(loss)]
    lowest = min(range(len(points)), key=lambda i: points[i][1], default=0)
    descent = points[min(skip_start, max(lowest - 2, 0)):lowest + 1]
    if len(descent) < 3:
        return None
    slopes = [(right[1] - left[1]) / (right[0] - left[0]) for left, right in zip(descent, descent[2:])]
    steepest = min(range(len(slopes)), key=slopes.__getitem__)
    return min(10 ** descent[steepest + 1][0], 10 ** points[lowest][0] / 10)


def find_lr(model, x, y, *, start_lr: float, end_lr: float, num_steps: int, batch_size: int, smoothing: float,
            divergence: float, plot, **fit_options) -> LRFinderResult:
    """The learning-rate range test on (x, y); see Model.find_lr (its defaults)."""
    check_positive_number(start_lr, "start_lr", "a positive learning rate")
    check_positive_number(end_lr, "end_lr", "a positive learning rate")
    if end_lr <= start_lr:
        raise ValueError(f"end_lr ({end_lr}) must be larger than start_lr ({start_lr}): the sweep raises the rate")
    check_positive_int(num_steps, "num_steps")
    if not 0 < smoothing <= 1:
        raise ValueError(f"smoothing must be in (0, 1] (the weight of each new loss), got {smoothing!r}")
    check_positive_number(divergence, "divergence", "a factor > 1 over the lowest smoothed loss")
    for name in SWEEP_OPTIONS:
        if name in fit_options:
            raise TypeError(f"find_lr runs its own sweep of num_steps steps; it takes no {name}")
    sweep = LRSweep(start_lr, end_lr, num_steps, smoothing, divergence)
    callbacks = [*callback_list(fit_options.pop("callbacks", None)), sweep]
    with undone_afterwards(model):
        model.fit(x, y, epochs=num_steps, batch_size=batch_size, callbacks=callbacks,
                  **{"verbose": 0, **fit_options})
    result = LRFinderResult(sweep.lrs[:len(sweep.losses)], sweep.losses, suggest_lr(sweep.lrs, sweep.losses))
    if plot:
        result.figure = result.plot(plot if isinstance(plot, (str, os.PathLike)) else None)
    return result
