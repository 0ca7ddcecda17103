"""The cost of counting a loss's items (tokens) on W1-like tiny steps: a fit whose cross entropy over (batch, time)
targets is counted (`loss="cross_entropy"`: each accumulation window read ahead and counted, each batch's loss summed
and divided by the window's items) against the same fit with the same cross entropy as a plain function, which
easyfit does not count (each batch's mean divided by the accumulation steps). One process, 1 torch thread, thread
CPU time per epoch, the two interleaved round by round; the ratio of their fastest epochs (a shared machine's
scatter only slows an epoch down) against a bar of 2 %, and the median of the rounds' ratios.

    python benchmarks/item_counts.py [--rounds 30] [--accumulate 2]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn
from torch.nn import functional as F

import easyfit
from easyfit.callbacks import Callback

SEQUENCES, LENGTH, VOCAB, BATCH = 4096, 16, 10, 64
BAR = 1.02


class TokenMLP(nn.Module):
    """W1's MLP (32 -> 64 -> 10) over each token: logits (batch, vocab, time)."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 32)
        self.mlp = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, VOCAB))

    def forward(self, x):
        return self.mlp(self.embed(x)).transpose(1, 2)


def uncounted(output, target):
    """The same cross entropy as a function of the user's: a per-batch mean, not counted."""
    return F.cross_entropy(output, target)


class EpochTime(Callback):
    def __init__(self):
        self.seconds = []

    def on_epoch_begin(self, epoch, logs=None):
        self.started = time.thread_time()

    def on_epoch_end(self, epoch, logs=None):
        self.seconds.append(time.thread_time() - self.started)


def data() -> tuple:
    generator = torch.Generator().manual_seed(0)
    x = torch.randint(0, VOCAB, (SEQUENCES, LENGTH), generator=generator)
    y = torch.randint(0, VOCAB, (SEQUENCES, LENGTH), generator=generator)
    lengths = torch.randint(1, LENGTH + 1, (SEQUENCES,), generator=generator)
    y[torch.arange(LENGTH) >= lengths[:, None]] = -100
    return x, y


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--accumulate", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(1)
    x, y = data()
    models = {}
    for name, loss in (("counted", "cross_entropy"), ("not counted", uncounted)):
        torch.manual_seed(0)
        models[name] = easyfit.Model(TokenMLP(), loss, "sgd")
        models[name].fit(x, y, batch_size=BATCH, epochs=1, verbose=0, gradient_accumulation_steps=args.accumulate)
    timers = {name: EpochTime() for name in models}
    for _ in range(args.rounds):
        for name, model in models.items():
            model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0, gradient_accumulation_steps=args.accumulate,
                      callbacks=[timers[name]])
    steps = SEQUENCES // BATCH
    fastest = {name: min(timer.seconds) / steps for name, timer in timers.items()}
    ratio = fastest["counted"] / fastest["not counted"]
    median = statistics.median(a / b for a, b in zip(timers["counted"].seconds, timers["not counted"].seconds))
    print(f"per step (fastest epoch of {args.rounds}): counted {fastest['counted'] * 1e3:.3f} ms, not counted "
          f"{fastest['not counted'] * 1e3:.3f} ms: ratio {ratio:.3f} ({'PASS' if ratio <= BAR else 'FAIL'}, bar "
          f"{BAR:.2f}); the median of the rounds' ratios {median:.3f}")
    return 0 if ratio <= BAR else 1

if __name__ == "__main__":
    raise SystemExit(main())
