"""Pipeline schedule efficiency: step time of strategy="pipeline" on 2 stages (GPipe) for 1, 2, 4 and 8 micro-batches,
beside the bubble fraction GPipe's theory gives, (p - 1) / (m + p - 1), and a plain PyTorch step on one process.

    python benchmarks/pipeline.py [--steps N] [--repeats R] [--accelerator cpu|cuda] [--schedule gpipe|1f1b]

The net is 8 blocks of Linear(1024, 1024) + ReLU and a Linear(1024, 10) head (8.4 M parameters), batch 512, SGD,
one torch thread per process on the CPU (the script re-runs itself as rank 1). Each figure is the median step after
3 warm-up steps, the fastest of R rounds over the counts. Before each pipeline run, rank 0 alone times the plain
step of the whole net (rank 1 waits for the next call, idle); "plain" is the fastest of those, the least disturbed
by other load. "ideal / plain" is the plain step split over p stages with GPipe's bubble: (m + p - 1) / (m p).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

import easyfit
from easyfit.callbacks import Callback
from easyfit.distributed.environments import launch_identity

BATCH, WARMUP, STAGES = 512, 3, 2


def make_net() -> torch.nn.Sequential:
    torch.manual_seed(0)
    blocks = [torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.ReLU()) for _ in range(8)]
    return torch.nn.Sequential(*blocks, torch.nn.Linear(1024, 10))


def make_data(steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return torch.randn(BATCH * steps, 1024, generator=generator), torch.randint(0, 10, (BATCH * steps,),
                                                                                generator=generator)


class StepTimes(Callback):
    def __init__(self):
        self.times, self.started = [], 0.0

    def on_train_batch_begin(self, batch, logs=None):
        self.started = time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
        self.times.append(time.perf_counter() - self.started)


def plain_step(steps: int, device: str) -> float:
    """Median step of a hand-written PyTorch loop on one process."""
    net = make_net().to(device)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.01)
    x, y = make_data(steps)
    times = []
    for step in range(steps):
        started = time.perf_counter()
        optimizer.zero_grad()
        batch = slice(step * BATCH, (step + 1) * BATCH)
        torch.nn.functional.cross_entropy(net(x[batch].to(device)), y[batch].to(device)).backward()
        optimizer.step()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
    return statistics.median(times[WARMUP:])


def pipeline_step(steps: int, microbatches: int, accelerator: str, schedule: str) -> float:
    x, y = make_data(steps)
    times = StepTimes()
    model = easyfit.Model(make_net(), "cross_entropy", "sgd", lr=0.01)
    strategy = easyfit.strategies.Pipeline(microbatches=microbatches, schedule=schedule, checkpoint="never")
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0, devices=STAGES, accelerator=accelerator,
              strategy=strategy, callbacks=[times])
    return statistics.median(times.times[WARMUP:])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--schedule", default="gpipe")
    parser.add_argument("--repeats", type=int, default=2, help="rounds over the counts; each figure is the fastest")
    args = parser.parse_args()
    torch.set_num_threads(1)
    device = "cuda" if args.accelerator == "cuda" else "cpu"
    counts = [m for m in (1, 2, 4, 8) if args.schedule != "1f1b" or m >= STAGES]
    plains, rows = [], {m: [] for m in counts}
    for _ in range(args.repeats):   # each round: the plain step (rank 0 alone), then the pipeline's for each count
        for m in counts:
            plains.append(plain_step(args.steps, device) if launch_identity()[0] == 0 else 0.0)
            rows[m].append(pipeline_step(args.steps, m, args.accelerator, args.schedule))
    if launch_identity()[0] != 0:
        return
    plain = min(plains)   # the least disturbed of the rounds
    rounds = ", ".join(f"{before * 1e3:.0f}" for before in plains)
    print(f"{STAGES} stages, {args.schedule}, batch {BATCH}; plain = a hand-written step of the whole net on one "
          f"process: {plain * 1e3:.1f} ms (the fastest of the rounds' {rounds} ms)")
    print(f"{'micro-batches':>13s} {'step ms':>8s} {'/ plain':>8s} {'ideal / plain':>14s} "
          f"{'bubble (p-1)/(m+p-1)':>21s}")
    for m, steps in rows.items():
        step = min(steps)
        ideal = (m + STAGES - 1) / m / STAGES
        bubble = (STAGES - 1) / (m + STAGES - 1)
        print(f"{m:13d} {step * 1e3:8.1f} {step / plain:8.2f} {ideal:14.2f} {bubble:21.2f}")

if __name__ == "__main__":
    main()
