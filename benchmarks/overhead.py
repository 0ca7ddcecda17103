"""easyfit's per-step overhead against a hand-written PyTorch loop, on the same data in the same process.

    python benchmarks/overhead.py [--quick] [--repeats N] [--threads T] [--clock wall|thread] [--only TEXT]

Both sides train the same architecture from the same initial weights on the same in-memory tensors. Epochs
are interleaved in rounds (hand, easyfit, then easyfit, hand, ...) so that a change in machine load hits both
alike. Each epoch is timed whole and divided by its number of steps; easyfit's epochs are timed by a callback
at on_epoch_begin / on_epoch_end, so fit's one-off setup is reported apart. The table shows the median
seconds per step of each side, the median over rounds of easyfit's time / the hand-written time, and the best
ratio (easyfit's fastest epoch / the hand-written loop's fastest) for reference. The verdict uses the median ratio.

Workloads and bars (easyfit / hand-written):
  W1 tiny            MLP 32-64-10, 20,000 samples, batch 64, SGD          <= 1.05 (progress bar off)
  W1 tiny, bar on    the same with verbose=1, the bar drawn to a null stream   reported only
  W1 compiled        W1 with fit(compile=True, steps_per_execution=1): one program per step   <= 0.50 (2x faster)
  W1 compiled, auto  W1 with fit(compile=True): "auto" runs 8 steps per program                 <= 0.33 (3x faster)
  W1 accuracy        W1 with metrics=["accuracy"]; the hand-written loop counts correct predictions   reported
  W1 compiled, auto, accuracy   the same with fit(compile=True)                                  reported
  W2 compute-bound   MLP 784-1024-1024-10, batch 128, Adam                <= 1.01
  W2 compiled        the same with fit(compile=True) (inductor)           <= 0.80 (at least 1.25x faster)
  W2 + EMA           W2 with callbacks=[EMA(0.999)] / W2 without it        reported (the "hand" column: easyfit
                     alone; benchmarks/ema_cost.py times EMA's update itself against its 3 % bar)

With jax installed, benchmarks/jax_reference.py times W1 written by hand in JAX + optax (a jitted step in a Python
loop, and the whole epoch in one lax.scan) in the same run, and the table gives each W1 row's ratio to the scan.

The default clock is this thread's CPU time: with one torch thread all the work runs on it, and it leaves out the
time spent waiting for a core, which on a shared 2-core VM makes epochs vary by several percent, more than W2's
1% bar. `--clock wall` times wall-clock seconds instead.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.util
import os
import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

import easyfit
from easyfit.callbacks import Callback

CLOCKS: dict[str, Callable[[], float]] = {"wall": time.perf_counter, "thread": time.thread_time}


@dataclass
class Workload:
    name: str
    sizes: tuple[int, ...]
    samples: int
    rounds: int
    batch_size: int
    optimizer: Callable[[list], torch.optim.Optimizer]
    verbose: int
    bar: float | None
    compile: bool = False   # easyfit's side with fit(compile=True); the hand-written loop stays eager
    steps_per_execution: int | str = "auto"
    one_fit: bool = False   # easyfit's epochs are those of one fit call (see `measure_in_one_fit`)
    #: easyfit's side with these callbacks, against easyfit without them (instead of the hand-written loop)
    callbacks: Callable[[], list] | None = None
    accuracy: bool = False   # easyfit with metrics=["accuracy"]; the hand-written loop counts correct predictions

    @property
    def steps(self) -> int:
        return -(-self.samples // self.batch_size)


def sgd(params) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.01)


def adam(params) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=1e-3)


def workloads() -> list[Workload]:
    """W2's epochs are short (4 steps) and many: its bar is tighter than an epoch's run-to-run noise,
    so it needs more pairs for the median ratio to settle."""
    return [
        Workload("W1 tiny", (32, 64, 10), 20_000, 40, 64, sgd, verbose=0, bar=1.05),
        Workload("W1 tiny, bar on", (32, 64, 10), 20_000, 40, 64, sgd, verbose=1, bar=None),
        Workload("W1 compiled", (32, 64, 10), 20_000, 40, 64, sgd, verbose=0, bar=0.5, compile=True,
                 steps_per_execution=1, one_fit=True),
        Workload("W1 compiled, auto", (32, 64, 10), 20_000, 40, 64, sgd, verbose=0, bar=1 / 3, compile=True,
                 one_fit=True),
        Workload("W1 accuracy", (32, 64, 10), 20_000, 40, 64, sgd, verbose=0, bar=None, accuracy=True),
        Workload("W1 compiled, auto, accuracy", (32, 64, 10), 20_000, 40, 64, sgd, verbose=0, bar=None, compile=True,
                 one_fit=True, accuracy=True),
        Workload("W2 compute-bound", (784, 1024, 1024, 10), 512, 300, 128, adam, verbose=0, bar=1.01),
        Workload("W2 compiled", (784, 1024, 1024, 10), 512, 300, 128, adam, verbose=0, bar=0.8, compile=True,
                 one_fit=True),
        Workload("W2 + EMA", (784, 1024, 1024, 10), 512, 300, 128, adam, verbose=0, bar=None, callbacks=ema),
    ]


def ema() -> list:
    from easyfit.callbacks import EMA
    return [EMA(decay=0.999)]


def mlp(sizes: tuple[int, ...]) -> nn.Module:
    layers: list[nn.Module] = []
    for fan_in, fan_out in zip(sizes, sizes[1:]):
        layers += [nn.Linear(fan_in, fan_out), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


class HandWritten:
    """The fast loop a careful user writes: a shuffled permutation per epoch and whole batches indexed out."""

    def __init__(self, net: nn.Module, work: Workload, x: torch.Tensor, y: torch.Tensor, clock: Callable[[], float]):
        self.net, self.optimizer, self.x, self.y = net, work.optimizer(net.parameters()), x, y
        self.batch_size, self.clock, self.accuracy = work.batch_size, clock, work.accuracy
        self.generator = torch.Generator().manual_seed(0)

    def epoch(self) -> float:
        """Train one epoch; its duration in seconds."""
        net, optimizer, x, y, batch_size = self.net, self.optimizer, self.x, self.y, self.batch_size
        started = self.clock()
        net.train()
        order = torch.randperm(len(x), generator=self.generator)
        correct = torch.zeros((), dtype=torch.long)
        for start in range(0, len(x), batch_size):
            idx = order[start:start + batch_size]
            output = net(x[idx])
            loss = F.cross_entropy(output, y[idx])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            if self.accuracy:
                correct += (output.detach().argmax(1) == y[idx]).sum()
        correct.item()
        return self.clock() - started


class EpochTimer(Callback):
    """The duration of the last training epoch (set at on_epoch_end)."""

    def __init__(self, clock: Callable[[], float]):
        self.clock = clock
        self.started = self.seconds = 0.0

    def on_epoch_begin(self, epoch, logs=None):
        self.started = self.clock()

    def on_epoch_end(self, epoch, logs=None):
        self.seconds = self.clock() - self.started


class EasyfitRun:
    """easyfit.Model.fit over the same tensors, one epoch per call, its output sent to a null stream."""

    def __init__(self, net: nn.Module, work: Workload, x: torch.Tensor, y: torch.Tensor, clock: Callable[[], float]):
        metrics = ["accuracy"] if work.accuracy else None
        self.model = easyfit.Model(net, "cross_entropy", work.optimizer, metrics=metrics)
        self.work, self.x, self.y, self.clock = work, x, y, clock
        self.setup_seconds: list[float] = []

    def epoch(self) -> float:
        """Train one epoch; its duration in seconds (fit's setup and teardown are kept in setup_seconds)."""
        timer = EpochTimer(self.clock)
        with open(os.devnull, "w") as null, contextlib.redirect_stdout(null), contextlib.redirect_stderr(null):
            started = self.clock()
            extra = self.work.callbacks() if self.work.callbacks is not None else []
            self.model.fit(self.x, self.y, epochs=1, batch_size=self.work.batch_size, verbose=self.work.verbose,
                           callbacks=[timer, *extra], lr_scaling=None, compile=self.work.compile,
                           steps_per_execution=self.work.steps_per_execution)
            self.setup_seconds.append(self.clock() - started - timer.seconds)
        return timer.seconds


@dataclass
class Result:
    work: Workload
    hand: float     # median seconds per step
    easyfit: float
    ratio: float    # median over rounds of easyfit / hand
    best_ratio: float   # easyfit's fastest epoch / the hand-written loop's fastest epoch
    setup: float    # median seconds of fit's work outside the epoch, per call

    @property
    def verdict(self) -> str:
        if self.work.bar is None:
            return "reported"
        return "PASS" if self.ratio <= self.work.bar else "FAIL"


class Interleaved(Callback):
    """Times each epoch of one fit and runs a hand-written epoch beside it: before it in odd epochs, after it in even
    ones. Epoch 0 (compilation, the first batch's checks) is the warm-up."""

    def __init__(self, hand: HandWritten, clock: Callable[[], float]):
        self.hand, self.clock = hand, clock
        self.started, self.hand_times, self.easy_times = 0.0, [], []

    def on_epoch_begin(self, epoch, logs=None):
        if epoch % 2:
            self.hand_times.append(self.hand.epoch())
        self.started = self.clock()

    def on_epoch_end(self, epoch, logs=None):
        seconds = self.clock() - self.started
        if epoch:
            self.easy_times.append(seconds)
            if epoch % 2 == 0:
                self.hand_times.append(self.hand.epoch())


def measure_in_one_fit(work: Workload, hand: HandWritten, easy: EasyfitRun, rounds: int,
                       clock: Callable[[], float]) -> tuple[list[float], list[float], list[float]]:
    """(hand, easyfit, setup) seconds of the epochs of one fit(epochs=rounds + 1), as a user trains: a fit's first
    batch runs eagerly (its checks), which in a 4-step W2 epoch per call would be a quarter of the steps."""
    interleaved = Interleaved(hand, clock)
    hand.epoch()
    with open(os.devnull, "w") as null, contextlib.redirect_stdout(null), contextlib.redirect_stderr(null):
        easy.model.fit(easy.x, easy.y, epochs=rounds + 1, batch_size=work.batch_size, verbose=work.verbose,
                       callbacks=[interleaved], lr_scaling=None, compile=work.compile,
                       steps_per_execution=work.steps_per_execution)
    return interleaved.hand_times, interleaved.easy_times, [0.0]


def measure(work: Workload, rounds: int, clock: Callable[[], float]) -> Result:
    """`rounds` interleaved pairs of epochs (hand-written and easyfit) after one warm-up epoch each."""
    torch.manual_seed(0)
    x = torch.randn(work.samples, work.sizes[0])
    y = torch.randint(0, work.sizes[-1], (work.samples,))
    hand_net, easy_net = mlp(work.sizes), mlp(work.sizes)
    easy_net.load_state_dict(hand_net.state_dict())
    hand = HandWritten(hand_net, work, x, y, clock) if work.callbacks is None else \
        EasyfitRun(hand_net, dataclasses.replace(work, callbacks=None), x, y, clock)   # easyfit without them
    easy = EasyfitRun(easy_net, work, x, y, clock)
    if work.one_fit:
        hand_times, easy_times, setup = measure_in_one_fit(work, hand, easy, rounds, clock)
        return Result(work, statistics.median(hand_times) / work.steps, statistics.median(easy_times) / work.steps,
                      statistics.median(e / h for e, h in zip(easy_times, hand_times)),
                      min(easy_times) / min(hand_times), statistics.median(setup))
    hand.epoch(), easy.epoch()   # warm-up: allocator, kernels, lazy imports, compilation
    easy.setup_seconds.clear()
    hand_times, easy_times = [], []
    for round_ in range(rounds):
        if round_ % 2 == 0:   # hand first, then easyfit first: a trend in machine load favours neither
            hand_times.append(hand.epoch())
            easy_times.append(easy.epoch())
        else:
            easy_times.append(easy.epoch())
            hand_times.append(hand.epoch())
    ratio = statistics.median(e / h for e, h in zip(easy_times, hand_times))
    return Result(work, statistics.median(hand_times) / work.steps, statistics.median(easy_times) / work.steps,
                  ratio, min(easy_times) / min(hand_times), statistics.median(easy.setup_seconds))


def print_table(results: list[Result]) -> None:
    header = (f"{'workload':<18} {'hand s/step':>12} {'easyfit s/step':>15} {'median ratio':>13} "
              f"{'best ratio':>11} {'bar':>6}  {'verdict':<9}fit setup")
    print(header)
    print("-" * len(header))
    for r in results:
        bar = f"{r.work.bar:.2f}" if r.work.bar is not None else "-"
        setup = "(one fit)" if r.work.one_fit else f"{r.setup * 1e3:.1f} ms"
        print(f"{r.work.name:<18} {r.hand:>12.3e} {r.easyfit:>15.3e} {r.ratio:>13.3f} {r.best_ratio:>11.3f} "
              f"{bar:>6}  {r.verdict:<9}{setup}")


def print_jax_ratios(results: list[Result]) -> None:
    """Each W1 row's seconds per step against W1 in JAX (benchmarks/jax_reference.py), when jax is installed."""
    if importlib.util.find_spec("jax") is None or not any(r.work.name.startswith("W1") for r in results):
        print("\nJAX reference: not measured (pip install jax jaxlib to print W1's ratio to it)")
        return
    from jax_reference import BATCH, SAMPLES, epoch_seconds
    per_step = {name: seconds / (SAMPLES // BATCH) for name, seconds in epoch_seconds().items()}
    print(f"\nJAX W1 (wall clock): jitted step in a Python loop {per_step['step']:.3e} s/step, whole epoch in one "
          f"lax.scan {per_step['scan']:.3e} s/step")
    for r in results:
        if r.work.name.startswith("W1"):
            print(f"  {r.work.name:<18} easyfit / JAX step {r.easyfit / per_step['step']:6.2f}   "
                  f"easyfit / JAX scan {r.easyfit / per_step['scan']:6.2f}   "
                  f"hand-written / JAX scan {r.hand / per_step['scan']:6.2f}")


def main() -> int:
    parser = argparse.ArgumentParser(description="easyfit's per-step overhead against a hand-written PyTorch loop")
    parser.add_argument("--quick", action="store_true", help="5 rounds per workload: a smoke run")
    parser.add_argument("--repeats", type=int, default=None,
                        help="interleaved rounds per workload (default 40 for W1, 300 for W2)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    parser.add_argument("--only", default=None, help="run the workloads whose name contains this text")
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="thread",
                        help="this thread's CPU time (default; needs --threads 1), or wall time")
    args = parser.parse_args()
    if args.clock == "thread" and args.threads != 1:
        parser.error("--clock thread measures one thread's CPU time; use it with --threads 1")
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, easyfit {easyfit.__version__}, torch threads {torch.get_num_threads()}, "
          f"{os.cpu_count()} CPUs, {args.clock} clock, interleaved rounds of one epoch per side")
    results = []
    for work in workloads():
        if args.only and args.only not in work.name:
            continue
        rounds = args.repeats or (5 if args.quick else work.rounds)
        results.append(measure(work, rounds, CLOCKS[args.clock]))
        print(f"  {work.name}: {work.steps} steps per epoch, {rounds} rounds, done", flush=True)
    print()
    print_table(results)
    print_jax_ratios(results)
    failed = [r.work.name for r in results if r.verdict == "FAIL"]
    print(f"\nverdict: {'every bar met' if not failed else 'over the bar: ' + ', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
