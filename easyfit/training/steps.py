"""How a call's steps run. The loop's own step runs them one batch at a time, eagerly; under `compile=` the
compiled steps (easyfit.compiled, imported only by a call that asks for them) give that step compiled parts to call
(the forward with the loss, the optimizer step) and give fit a `StepRunner`: a faster way of running an epoch's
steps, the whole step as one program, N steps per call."""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, Callable, Protocol

from easyfit.data.contents import forward_loss


class StepRunner(Protocol):
    """Runs an epoch's training steps from a batch on, in place of the loop's step (easyfit.compiled.multi_step).
    For what the loop's step does besides the forward, the backward and the update, it calls the loop's own pieces:
    `begin_batch`, the LR scale (`before_step` / `after_step`), `track` and `end_batch` (the logs and hooks), and
    `train_batch` for a batch it does not run itself."""

    def ready(self, step: int) -> bool:
        """Whether it takes over at batch `step` of the epoch."""

    def train(self, batches: Iterator, step: int, epoch_run) -> int:
        """Train `batches`, the first of which is batch `step`; the index of the last batch trained."""


class ModelSteps:
    """A Model's steps: the loop's own forward and loss, or under a call's `compile=` its compiled steps, whose
    programs stay in `cache` between calls, so that fitting again (or one epoch per call) compiles nothing anew."""

    def __init__(self):
        self.cache: dict = {}
        self.declined: set = set()   # the reasons a fit's step could not be one program, each said once
        self.compiled = None   # the current call's compiled steps (easyfit.compiled.steps.CompiledSteps), or None

    @property
    def settings(self) -> dict | None:
        """The current call's torch.compile settings; None: eager."""
        return None if self.compiled is None else self.compiled.settings

    def step(self, role: str) -> Callable:
        """forward_loss(net, loss_fn, inputs, target) -> (output, loss) of `role` ("train", "evaluate", "predict")."""
        return forward_loss if self.compiled is None else self.compiled.step(role)

    def optimizer_step(self, optimizer, precision, strategy) -> Callable[[], None] | None:
        """The optimizer step compiled; None: the strategy steps the optimizer."""
        return None if self.compiled is None else self.compiled.optimizer_step(optimizer, precision, strategy)

    def runner(self, loop) -> StepRunner | None:
        """What runs a fit's steps in place of the loop's step once it can; None: the loop's step runs them all."""
        return None if self.compiled is None else self.compiled.runner(loop)

    @contextlib.contextmanager
    def running(self, settings: dict | None, strategy, say: Callable[[str], Any] | None = None):
        """A call with the plan's `compile` settings (None: eager); `say` (print, say) gets a line on what the call
        compiled and how long that took."""
        if settings is None:
            yield
            return
        from easyfit.compiled.steps import CompiledSteps
        self.compiled = CompiledSteps(settings, self.cache, self.declined)
        try:
            with self.compiled.running(strategy, say):
                yield
        finally:
            self.compiled = None

    def __getstate__(self) -> dict:
        """Compiled functions do not pickle: a process that receives the Model compiles its own."""
        return {"cache": {}, "declined": set(), "compiled": None}


def step_function(forward_loss: Callable, loss_fn, first_step) -> Callable:
    """step_fn(net, inputs, target) -> (output, target, loss): a batch's forward and loss through `forward_loss` (no
    loss without `loss_fn`), the first batch's through its `FirstStep` (the checks, and the target as the loss
    takes it). The strategy's training_step / evaluation_step calls it."""
    if first_step is not None:
        if loss_fn is None:
            return lambda net, inputs, target: (first_step.forward(net, inputs), target, None)
        return lambda net, inputs, target: first_step.forward_and_loss(net, inputs, target, loss_fn)

    def step_fn(net, inputs, target):
        output, loss = forward_loss(net, loss_fn, inputs, target)
        return output, target, loss
    return step_fn
