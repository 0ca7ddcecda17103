"""What a call and a fit hold in a process while they run, apart from the strategy object (its configuration)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class CallState:
    """What one call (fit, evaluate, predict) holds in this process; a backend subclasses it, as FitState."""


@dataclass
class FitState:
    """What one fit holds on one rank, from `setup` to the fit's end; a backend subclasses it (a dataclass in its
    module) with its own fields."""


@dataclass
class ComingFit(FitState):
    """The fit state from `configure_training` to `setup`: the fit's `TrainingSettings`, which `setup` builds from."""

    settings: Any
