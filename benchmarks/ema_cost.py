"""EMA's own per-step cost on W2 (MLP 784-1024-1024-10, Adam, batch 128, 1 torch thread): the CPU time of its
batch hook (the one fused `torch._foreach_lerp_` over the weights, and the call) against the rest of the step, in
one long fit, against a bar of 3 %. Interleaved epoch ratios (benchmarks/overhead.py --only "W2 + EMA") scatter by
more than this cost on a shared machine; this times the update itself.

    python benchmarks/ema_cost.py [--epochs 60]
"""
from __future__ import annotations

import argparse
import time

import torch
from overhead import adam, mlp

import easyfit
from easyfit.callbacks import EMA, Callback


class TimedEMA(EMA):
    """EMA whose batch hook adds its thread CPU time to `spent`."""

    spent = 0.0

    def on_train_batch_end(self, batch, logs=None):
        started = time.thread_time()
        super().on_train_batch_end(batch, logs)
        TimedEMA.spent += time.thread_time() - started


class EpochTime(Callback):
    total = 0.0

    def on_epoch_begin(self, epoch, logs=None):
        self.started = time.thread_time()

    def on_epoch_end(self, epoch, logs=None):
        EpochTime.total += time.thread_time() - self.started


BAR = 0.03


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=60)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    x, y = torch.randn(512, 784), torch.randint(0, 10, (512,))
    model = easyfit.Model(mlp((784, 1024, 1024, 10)), "cross_entropy", adam)
    model.fit(x, y, batch_size=128, epochs=5, verbose=0, lr_scaling=None, callbacks=[EpochTime(), TimedEMA()])
    TimedEMA.spent = EpochTime.total = 0.0   # after the warm-up fit
    model.fit(x, y, batch_size=128, epochs=args.epochs, verbose=0, lr_scaling=None,
              callbacks=[EpochTime(), TimedEMA(0.999)])
    steps, share = args.epochs * 4, TimedEMA.spent / (EpochTime.total - TimedEMA.spent)
    print(f"EMA's hook {TimedEMA.spent / steps * 1e3:.3f} ms per step, the step without it "
          f"{(EpochTime.total - TimedEMA.spent) / steps * 1e3:.2f} ms: {share * 100:.2f} % "
          f"({'PASS' if share <= BAR else 'FAIL'}, bar {BAR * 100:.0f} %)")
    return 0 if share <= BAR else 1


if __name__ == "__main__":
    raise SystemExit(main())
