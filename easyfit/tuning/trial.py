"""Trial fits (the learning-rate and batch-size finders): fits whose every effect is undone afterwards."""
from __future__ import annotations

import contextlib

from easyfit.saving.model_state import kept


@contextlib.contextmanager
def undone_afterwards(model):
    """Inside the block, fit as often as needed; after it (even when it raised) the net's weights, the optimizer,
    the scheduler, the loss scaler, the history, the callbacks' state, the epoch count and torch's random number
    generators are as they were before it, bit for bit. Holds one copy of that state (on the CPU) meanwhile."""
    with kept(model, training_state=True):
        yield
