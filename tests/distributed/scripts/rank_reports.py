"""What a user hears from 2 CPU processes, run by test_rank_reports.py: the cause of a failure in words, a stuck rank
by name, and rank 0's callback state and warnings back in the caller.

Usage: python rank_reports.py OUT_DIR SCENARIO STRATEGY
SCENARIO: unused (a parameter that gets no gradient on rank 1), stuck (rank 1 hangs; the process group times out),
hand_back (TerminateOnNaN stops training; the caller writes OUT_DIR/caller.json with what came back).
"""
import json
import os
import sys
import time
import warnings
from datetime import timedelta

import torch
from torch import nn

import easyfit
from easyfit.callbacks import Callback, TerminateOnNaN

OUT, SCENARIO, STRATEGY = os.path.abspath(sys.argv[1]), sys.argv[2], sys.argv[3]


class Branchy(nn.Module):
    """`extra` takes part only in batches whose first feature sums positive: on rank 1 never (see `data`)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.base, self.extra = nn.Linear(6, 3), nn.Linear(6, 3)

    def forward(self, x):
        out = self.base(x)
        return out + self.extra(x) if x[:, 0].sum() > 0 else out


class Counter(Callback):
    """A user's callback with its own counters and no state_dict; warns once on rank 0."""

    def __init__(self):
        self.batches, self.ranks = 0, set()

    def on_train_batch_end(self, batch, logs=None):
        self.batches += 1
        self.ranks.add(self.model.global_rank)

    def on_train_end(self, logs=None):
        if self.model.is_global_zero:
            warnings.warn("a warning raised on rank 0", UserWarning, stacklevel=1)


class Hang(Callback):
    def on_train_batch_end(self, batch, logs=None):
        if self.model.global_rank == 1 and batch == 2:
            time.sleep(3600)


def data():
    x = torch.randn(64, 6, generator=torch.Generator().manual_seed(0))
    x[:, 0] = torch.where(torch.arange(64) % 2 == 0, 5.0, -5.0)   # rank 0 gets the even samples, rank 1 the odd
    return x, torch.arange(64) % 3


def main() -> None:
    torch.set_num_threads(1)
    x, y = data()
    run = {"devices": 2, "accelerator": "cpu", "verbose": 0, "batch_size": 4, "shuffle": False}
    if SCENARIO == "unused":   # TerminateOnNaN reduces after every step: a collective beside DDP's all-reduce
        easyfit.Model(Branchy(), "cross_entropy", "sgd", lr=0.1).fit(x, y, epochs=2, strategy=STRATEGY,
                                                                    callbacks=[TerminateOnNaN()], **run)
    elif SCENARIO == "stuck":
        strategy = easyfit.strategies.DDP(start_method=STRATEGY, timeout=timedelta(seconds=15))
        easyfit.Model(nn.Linear(6, 3), "cross_entropy", "sgd").fit(x, y, epochs=3, callbacks=[Hang()],
                                                                   strategy=strategy, **run)
    elif SCENARIO == "hand_back":
        x[24] = float("nan")   # in rank 0's batch 3
        terminate, counter = TerminateOnNaN(), Counter()
        model = easyfit.Model(nn.Linear(6, 3), "cross_entropy", "sgd")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model.fit(x, y, epochs=2, callbacks=[terminate, counter], strategy=STRATEGY, **run)
        with open(os.path.join(OUT, "caller.json"), "w") as file:
            json.dump({"message": terminate.message, "batches": counter.batches, "ranks": sorted(counter.ranks),
                       "warnings": [str(w.message) for w in caught]}, file)
    else:
        raise SystemExit(f"unknown scenario {SCENARIO!r}")


if __name__ == "__main__":
    main()
