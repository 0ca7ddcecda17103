"""The cost of counting a loss's items (tokens) on W1-like tiny steps (W1's MLP over each of 16 tokens, batch 64,
SGD, one process, 1 torch thread), two ways:
- the counting itself: the thread CPU time of what a counted epoch adds (each accumulation window read ahead, its
  items counted, D set; each batch's loss and items kept, and summed at the epoch's end), over the epoch's real
  batches, against the step's time: the bar, 2 %;
- whole fits, interleaved round by round: `loss="cross_entropy"` (counted: each batch's loss summed, over D) against
  the same cross entropy as a plain function, which easyfit does not count (each batch's mean over the
  accumulation steps); the ratio of their fastest epochs and the median of the rounds' ratios. On a shared machine
  these scatter by more than the counting costs (reported, not held to the bar).

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
from easyfit.distributed.strategies.base import Strategy
from easyfit.parts.item_counts import item_counting
from easyfit.parts.losses import resolve_loss
from easyfit.training.epoch_logs import LossTracker
from easyfit.training.item_windows import ItemSteps

SEQUENCES, LENGTH, VOCAB, BATCH = 4096, 16, 10, 64
BAR = 0.02


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


def counting_seconds(x, y, accumulate: int, rounds: int = 20) -> float:
    """Thread CPU time per batch of what counting adds to an epoch, the fastest of `rounds` epochs."""
    loss = resolve_loss("cross_entropy")
    steps = ItemSteps(item_counting(loss), loss, torch.device("cpu"))
    batches = [(x[start:start + BATCH], y[start:start + BATCH]) for start in range(0, len(x), BATCH)]
    losses = [torch.tensor(1.0) for _ in batches]
    fastest = float("inf")
    for _ in range(rounds):
        started = time.thread_time()
        windows, tracker = steps.epoch(Strategy(), accumulate, len(batches), across_ranks=True), LossTracker()
        for _, loss_value in zip(windows.batches(batches, 0), losses):
            items, scale = windows.next_count()
            tracker.add_counted(loss_value, scale, items)
        tracker.totals()
        fastest = min(fastest, time.thread_time() - started)
    return fastest / len(batches)


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
    median = statistics.median(a / b for a, b in zip(timers["counted"].seconds, timers["not counted"].seconds))
    counting = counting_seconds(x, y, args.accumulate)
    share = counting / fastest["not counted"]
    print(f"accumulation {args.accumulate}: the counting {counting * 1e6:.1f} µs per batch, {share * 100:.2f} % of "
          f"the step ({'PASS' if share <= BAR else 'FAIL'}, bar {BAR * 100:.0f} %); whole fits, per step (fastest "
          f"epoch of {args.rounds}): counted {fastest['counted'] * 1e3:.3f} ms, not counted "
          f"{fastest['not counted'] * 1e3:.3f} ms, ratio {fastest['counted'] / fastest['not counted']:.3f}; the "
          f"median of the rounds' ratios {median:.3f}")
    return 0 if share <= BAR else 1

if __name__ == "__main__":
    raise SystemExit(main())
