"""launcher="ray" against Ray used bare: a hand-written TorchTrainer whose train_loop_per_worker is the plain PyTorch
loop (DDP over the process group Ray made), on the same data and the same 2 workers of one local Ray cluster; an
elastic fit (Ray(num_workers=(1, 2)), which takes the cluster's 2 workers) against the fixed-size one; and easyfit's
ddp_spawn on the same machine, for scale.

    python benchmarks/ray_launcher.py [--steps N] [--repeats R]

All train the MLP 784-512-512-10 with SGD, batch 128 per worker, one torch thread per worker, for the same steps.
first step: seconds from the call (trainer.fit() / model.fit()) to rank 0 beginning its first step (the cluster is
started before, once). step: rank 0's median seconds per step after the first 5. Runs alternate (bare, easyfit,
elastic, spawn, bare, ...) so that a change in machine load hits all alike; medians over the repeats are printed,
with the ratios easyfit / bare and elastic / easyfit. Bars: first step within 1.2 × the bare trainer's, step time
within 1.05 ×; the elastic fit's first step and step time within 1.1 × the fixed-size fit's.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import ray
import torch
from ray.train import RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer
from torch import nn

import easyfit
from easyfit.callbacks import Callback

BATCH, WARMUP = 128, 5


def make_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))


def make_data(steps: int):
    generator = torch.Generator().manual_seed(0)
    samples = steps * BATCH * 2
    return torch.randn(samples, 784, generator=generator), torch.randint(0, 10, (samples,), generator=generator)


def bare_loop(config: dict) -> None:
    """The plain PyTorch loop a Ray user writes: DDP over Ray's group, this worker's shard, SGD."""
    import ray.train
    torch.set_num_threads(1)
    x, y = ray.get(config["data"])
    context = ray.train.get_context()
    rank, world = context.get_world_rank(), context.get_world_size()
    x, y = x[rank::world].contiguous(), y[rank::world].contiguous()
    net = nn.parallel.DistributedDataParallel(make_net())
    optimizer = torch.optim.SGD(net.parameters(), lr=0.01)
    stamps = []
    for start in range(0, len(x), BATCH):
        stamps.append(time.time())
        loss = nn.functional.cross_entropy(net(x[start:start + BATCH]), y[start:start + BATCH])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    stamps.append(time.time())
    if rank == 0:
        with open(config["out"], "w") as file:
            json.dump(stamps, file)


class StepStamps(Callback):
    """Rank 0's time at the start of every step, and at the end of the last. It never stops training (a callback
    whose batch hooks may stop it makes every rank agree after each step: one small all-reduce the bare loop lacks)."""

    may_stop_training = False

    def __init__(self, out: str):
        self.out, self.stamps = out, []

    def on_train_batch_begin(self, batch, logs=None):
        self.stamps.append(time.time())

    def on_train_end(self, logs=None):
        if self.model.is_global_zero:
            with open(self.out, "w") as file:
                json.dump([*self.stamps, time.time()], file)


def timings(called: float, out: str) -> dict:
    with open(out) as file:
        stamps = json.load(file)
    steps = [after - before for before, after in zip(stamps[WARMUP:], stamps[WARMUP + 1:])]
    return {"first_step": stamps[0] - called, "step": statistics.median(steps)}


def run(side: str, data, steps: int, folder: str) -> dict:
    out = os.path.join(folder, f"{side}-{time.time_ns()}.json")
    called = time.time()
    if side == "bare":
        TorchTrainer(bare_loop, train_loop_config={"data": ray.put(data), "out": out},
                     scaling_config=ScalingConfig(num_workers=2),
                     run_config=RunConfig(storage_path=folder)).fit()
        return timings(called, out)
    model = easyfit.Model(make_net(), loss="cross_entropy", optimizer="sgd", lr=0.01)
    launcher = {"easyfit": easyfit.launchers.Ray(num_workers=2, storage_path=folder), "spawn": "auto",
                "elastic": easyfit.launchers.Ray(num_workers=(1, 2), storage_path=folder)}[side]
    model.fit(*data, batch_size=BATCH, epochs=1, shuffle=False, verbose=0, lr_scaling=None,
              devices=2 if side == "spawn" else 1, strategy="ddp_spawn" if side == "spawn" else "ddp",
              launcher=launcher, callbacks=[StepStamps(out)])
    return timings(called, out)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    os.environ["OMP_NUM_THREADS"] = "1"
    started = time.time()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    print(f"ray.init: {time.time() - started:.1f} s")
    data = make_data(args.steps)
    results: dict[str, list[dict]] = {"bare": [], "easyfit": [], "elastic": [], "spawn": []}
    with tempfile.TemporaryDirectory(prefix="easyfit-bench-ray-") as folder:
        for repeat in range(args.repeats):
            for side in results:
                results[side].append(run(side, data, args.steps, folder))
                print(f"repeat {repeat + 1} {side}: {results[side][-1]}", flush=True)
    ray.shutdown()
    medians = {side: {key: statistics.median(r[key] for r in runs) for key in ("first_step", "step")}
               for side, runs in results.items()}
    for side, median in medians.items():
        print(f"{side:8s} call to first step {median['first_step']:6.2f} s   step {median['step'] * 1e3:7.2f} ms")
    first = medians["easyfit"]["first_step"] / medians["bare"]["first_step"]
    step = medians["easyfit"]["step"] / medians["bare"]["step"]
    print(f"easyfit / bare: first step {first:.3f} (bar <= 1.2), step {step:.3f} (bar <= 1.05)")
    first = medians["elastic"]["first_step"] / medians["easyfit"]["first_step"]
    step = medians["elastic"]["step"] / medians["easyfit"]["step"]
    print(f"elastic / easyfit: first step {first:.3f} (bar <= 1.1), step {step:.3f} (bar <= 1.1)")


if __name__ == "__main__":
    main()
