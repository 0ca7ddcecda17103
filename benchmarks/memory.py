"""Memory each rank holds, DDP against every sharded strategy, on 2 CPU processes (gloo).

    python benchmarks/memory.py [--steps N] [--strategies ddp,zero,...]

Each strategy trains the MLP 784-1024-1024-1024-10 (2.9 M parameters) with Adam, batch 64 per process, one torch
thread per process, for N steps (the script re-runs itself as rank 1). Measured on each rank, from the tensors it
holds (the local slice of a sharded tensor, a ZeRO-3 partition):
  parameters       bytes of the net's parameters after the first step
  gradients        bytes of the gradients the stepping optimizer sees, when it steps (first step); n/a where the
                   backend keeps them in buffers of its own (DeepSpeed stage 3)
  optimizer state  bytes of the optimizer's state (Adam's two moments) after the first step
  step             median wall time of a training step after 3 warm-up steps
Ratios are against DDP's figures; the table lists rank 0 (rank 1 differs by at most a partition's padding).
"""
from __future__ import annotations

import argparse
import importlib.util
import statistics
import time

import torch

import easyfit
from easyfit.callbacks import Callback
from easyfit.distributed.strategies.sharding import local_bytes, rank_memory, stepping_optimizer

STRATEGIES = ["ddp", "zero", "fsdp", "fsdp_cpu_offload", "ddp_sharded", "deepspeed_stage_1", "deepspeed_stage_2",
              "deepspeed_stage_2_offload", "deepspeed_stage_3", "deepspeed_stage_3_offload"]
NEEDS = {"ddp_sharded": "fairscale", "deepspeed": "deepspeed"}
WARMUP = 3


class Measure(Callback):
    """Bytes after the first step, gradient bytes at the first optimizer step, and the time of each step."""

    def __init__(self):
        self.figures, self.times, self.started = {}, [], 0.0

    def on_train_begin(self, logs=None):
        training = self.model._training
        stepping = stepping_optimizer(training.optimizer)
        tensors = [*training.net.parameters(), *(p for g in stepping.param_groups for p in g["params"])]
        step = stepping.step

        def measured_step(*args, **kwargs):
            if "gradients" not in self.figures:
                grads = {id(p): p.grad for p in tensors if p.grad is not None}
                self.figures["gradients"] = local_bytes(grads.values())
            return step(*args, **kwargs)
        stepping.step = measured_step

    def on_train_batch_begin(self, batch, logs=None):
        self.started = time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
        self.times.append(time.perf_counter() - self.started)
        if batch == 0:
            self.figures.update(rank_memory(self.model._training.net, self.model._training.optimizer))

    def on_train_end(self, logs=None):
        row = torch.tensor([float(self.figures["parameters"]), float(self.figures.get("gradients", 0)),
                            float(self.figures["optimizer_state"]), statistics.median(self.times[WARMUP:])],
                           dtype=torch.float64)
        self.rows = self.model.strategy.all_gather(row)


def measure(strategy: str, steps: int) -> list[torch.Tensor]:
    torch.manual_seed(0)
    x, y = torch.randn(64 * 2 * steps, 784), torch.randint(0, 10, (64 * 2 * steps,))
    layers = [torch.nn.Linear(784, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 1024), torch.nn.ReLU(),
              torch.nn.Linear(1024, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 10)]
    net = torch.nn.Sequential(*layers)
    model = easyfit.Model(net, "cross_entropy", torch.optim.Adam(net.parameters(), lr=1e-3))
    callback = Measure()
    model.fit(x, y, batch_size=64, epochs=1, shuffle=False, verbose=0, lr_scaling=None, devices=2,
              accelerator="cpu", strategy=strategy, callbacks=[callback])
    return callback.rows


def available(strategy: str) -> bool:
    package = next((package for prefix, package in NEEDS.items() if strategy.startswith(prefix)), None)
    return package is None or importlib.util.find_spec(package) is not None


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--strategies", default=",".join(STRATEGIES))
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = {name: measure(name, args.steps) for name in args.strategies.split(",") if available(name)}
    if easyfit.distributed.environments.launch_identity()[0] != 0:
        return
    baseline = rows["ddp"][0]
    print(f"{'strategy':26s} {'parameters':>14s} {'gradients':>14s} {'optimizer':>14s} {'step ms':>12s}")
    for name, (rank0, _) in rows.items():
        cells = [f"{rank0[i] / 1e6:6.2f} MB {rank0[i] / baseline[i]:4.2f}x" if rank0[i] else f"{'n/a':>14s}"
                 for i in range(3)]
        print(f"{name:26s} {' '.join(cells)} {rank0[3] * 1e3:6.1f} {rank0[3] / baseline[3]:4.2f}x")


if __name__ == "__main__":
    main()
