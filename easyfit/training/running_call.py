"""The one object a call (fit, evaluate, predict, a search) keeps on the Model while it runs, and what a call leaves
the Model that outlives it."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from easyfit.callbacks.base import CallbackList
from easyfit.distributed.strategies.base import Strategy
from easyfit.distributed.strategies.states import CallState, Fit
from easyfit.parts.precision import Precision


@dataclass
class RunningCall:
    """A call's state on one rank, made by the rank body and dropped at its end (`Model.running`); the Model and
    the callbacks read it through `model.strategy`, `model.optimizer`, `model.stop_training`, ... ."""
    strategy: Strategy
    precision: Precision
    identity: tuple[int, int] | None = None   # (rank, world size) of a multi-process call
    call_state: CallState | None = None   # what the call holds in this process (the strategy's setup_environment)
    training: Fit | None = None   # the fit's own object (what the strategy's setup returned), while the fit trains
    train_batches: Any = None   # the fit's training batches (SWA's BatchNorm pass reads them)
    loss_fn: Any = None   # the fit's loss (weighted when weights were given); None: the Model's own
    lr_multiplier: float = 1.0   # the optimizer keeps the schedule's rates; each step takes them scaled
    callbacks: CallbackList | None = None   # a fit's: the History, the progress display, the user's callbacks
    stop_training: bool = False


@dataclass(frozen=True)
class LastCall:
    """What the last call leaves the Model, kept until the next: `model.save` after it writes its loss scaler, its
    fit's callbacks' states and its strategy's device generator; the next call starts from its precision;
    `model.global_rank` after it is its rank, `model.stop_training` whether the last fit was stopped."""
    strategy: Strategy
    precision: Precision
    callbacks: CallbackList
    identity: tuple[int, int] | None = None
    stop_training: bool = False

    def after(self, call: RunningCall) -> LastCall:
        """What `call` leaves: its strategy, precision and identity, and when it was a fit its callbacks and
        whether it was stopped."""
        fit = call.callbacks is not None
        return LastCall(call.strategy, call.precision, call.callbacks if fit else self.callbacks, call.identity,
                        call.stop_training if fit else self.stop_training)
