"""Trial fits (the learning-rate and batch-size finders): fits whose every effect is undone afterwards."""
from __future__ import annotations

import contextlib
import copy


@contextlib.contextmanager
def undone_afterwards(model):
    """Inside the block, fit as often as needed; after it (even when it raised) the net's weights, the optimizer,
    the scheduler, the loss scaler, the history, the callbacks' state, the epoch count and torch's random number
    generators are as they were before it, bit for bit. Holds one copy of that state meanwhile."""
    state = copy.deepcopy(model.checkpoint_state())
    history, callbacks, precision = model.history, model._callbacks, model._precision
    try:
        yield
    finally:
        model.history, model._callbacks, model._precision = history, callbacks, precision
        model.restore(state, training=True)
        model.stop_training = False
