"""Where every attempt of a restartable call starts in the caller's process.

With the script re-run (`strategy="ddp"` from a script, `easyfit.launch`), rank 0 is the process that called fit
and trains the caller's own objects, while the ranks started again for a new attempt run the script afresh. A failed
attempt leaves its state in the caller's objects: the weights and the optimizer moved on, the metrics built with
their task already shared among the ranks, the callbacks' counters advanced, random numbers drawn. Collectives that
depend on that state (the metrics' one-time task exchange) then differ between rank 0 and the new ranks, and the
rest differs silently. So before each restart the caller's objects get back the state they had before the first
attempt: every rank starts every attempt from the same state, as the ranks of ddp_spawn do (each attempt starts
from a copy of the caller's objects)."""
from __future__ import annotations

import copy
import pickle

import torch

from easyfit.distributed.from_rank_zero import callback_attributes, restore_callback_attributes
from easyfit.distributed.strategy_parts.construction import built_sharded
from easyfit.saving.model_state import Snapshot


class AttemptStart:
    """A copy (on the CPU) of the caller's Model and callbacks before the first attempt, and putting it back.

    A net built sharded (`strategy.module_construction()`) holds no weights to copy before its first fit: its
    weights and optimizer come from the fault-tolerance checkpoint alone; the rest is put back as for any net."""

    def __init__(self, model, callbacks: list):
        self.model, self.callbacks = model, list(callbacks)
        self.snapshot = Snapshot(model, training_state=built_sharded(model.net) is None)
        self.rng = torch.get_rng_state()
        self.metrics = copy.deepcopy(model.metrics)
        self.attributes = pickle.dumps(callback_attributes(self.callbacks))

    def put_back(self) -> None:
        """The caller's objects as they were before the first attempt (a fresh copy each time)."""
        self.snapshot.put_back(again=True)   # weights, optimizer, scheduler, History, epoch, ...
        torch.set_rng_state(self.rng)
        self.model.metrics = copy.deepcopy(self.metrics)
        self.model.stop_training = False
        restore_callback_attributes(self.callbacks, pickle.loads(self.attributes))
