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

    python benchmarks/memory.py --pipeline [--steps N]

--pipeline trains 4 blocks of Linear(1024, 1024) + ReLU and a Linear(1024, 10) head (4.2 M parameters) with
strategy="pipeline" (2 stages, balance "auto") and prints each stage's bytes of parameters + gradients + Adam state
beside the whole net's and its share (each stage must hold at most its share + 10 %).

    python benchmarks/memory.py --cuda [--strategies single,deepspeed_stage_2,...]

On one CUDA GPU: the peak GPU memory (torch.cuda.max_memory_allocated) of one epoch of the MLP
2048-4096-4096-2048-10 (33.6 M parameters) with Adam, batch 256, devices=1, each strategy in a fresh process, beside
a hand-written CUDA loop's, with the bars each strategy must stay under (ratios to the hand-written loop).

    python benchmarks/memory.py --cpu-allocated [--strategies ...]

The same on the CPU with accelerator="cpu": the peak of the bytes torch allocates from the start of the fit, from
the allocations and frees the profiler records. The net is built before, so its own weights count for none of the
lines (on a GPU they count where they move there: the hand-written loop and the strategies that train the net in
place); a sharding backend's copy of them, and the buffers it allocates on its device, count as they would on a GPU.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import subprocess
import sys
import time

import torch
from torch._C._autograd import DeviceType

import easyfit
from easyfit.callbacks import Callback
from easyfit.distributed.memory import estimate
from easyfit.distributed.strategy_parts.sharding import local_bytes, rank_memory, stepping_optimizer

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


def mlp() -> torch.nn.Sequential:
    return torch.nn.Sequential(torch.nn.Linear(784, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 1024),
                               torch.nn.ReLU(), torch.nn.Linear(1024, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 10))


def blocks() -> torch.nn.Sequential:
    """Four equal blocks and a small head: layers a pipeline can cut into equal stages."""
    block = [torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.ReLU()) for _ in range(4)]
    return torch.nn.Sequential(*block, torch.nn.Linear(1024, 10))


def measure(strategy: str, steps: int, net: torch.nn.Module | None = None) -> list[torch.Tensor]:
    torch.manual_seed(0)
    net = net or mlp()
    features = net[0].in_features if isinstance(net[0], torch.nn.Linear) else 1024
    x, y = torch.randn(64 * 2 * steps, features), torch.randint(0, 10, (64 * 2 * steps,))
    model = easyfit.Model(net, "cross_entropy", torch.optim.Adam(net.parameters(), lr=1e-3))
    callback = Measure()
    model.fit(x, y, batch_size=64, epochs=1, shuffle=False, verbose=0, lr_scaling=None, devices=2,
              accelerator="cpu", strategy=strategy, callbacks=[callback])
    return callback.rows


def available(strategy: str) -> bool:
    package = next((package for prefix, package in NEEDS.items() if strategy.startswith(prefix)), None)
    return package is None or importlib.util.find_spec(package) is not None


ONE_DEVICE_STRATEGIES = ["single", "ddp", "deepspeed_stage_1", "deepspeed_stage_2", "deepspeed_stage_3",
                         "deepspeed_stage_2_offload", "deepspeed_stage_3_offload", "fsdp", "fsdp_cpu_offload", "zero",
                         "ddp_sharded"]
#: the most peak GPU memory each may hold, as a ratio to the hand-written loop's
CUDA_BARS = {"deepspeed_stage_1": 1.25, "deepspeed_stage_2": 1.25, "deepspeed_stage_3": 1.5,
             "deepspeed_stage_2_offload": 0.75, "deepspeed_stage_3_offload": 0.75, "fsdp_cpu_offload": 0.65}
ONE_DEVICE_SAMPLES, ONE_DEVICE_BATCH = 2560, 256


class PeakAllocated:
    """Peak bytes torch allocates on `device` inside the block: CUDA's allocator statistics, or on the CPU the
    allocations and frees the profiler records (the CPU allocator keeps no statistics)."""

    def __init__(self, device: str):
        self.device, self.bytes, self.profile = device, 0.0, None

    def __enter__(self):
        if self.device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        else:
            self.profile = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                                  profile_memory=True)
            self.profile.__enter__()
        return self

    def __exit__(self, *error):
        if self.device == "cuda":
            torch.cuda.synchronize()
            self.bytes = float(torch.cuda.max_memory_allocated())
            return
        self.profile.__exit__(*error)
        changes = sorted((event.start_ns(), event.nbytes()) for event in self.profile.profiler.kineto_results.events()
                         if event.device_type() == DeviceType.CPU and _is_memory(event))
        level = 0
        for _, change in changes:
            level += change
            self.bytes = max(self.bytes, float(level))


def _is_memory(event) -> bool:
    try:
        return event.name() == "[memory]"
    except UnicodeDecodeError:   # the profiler may record a Python frame whose name it cannot decode
        return False


def one_device_peak(strategy: str, device: str) -> float:
    """Peak bytes on `device` of one epoch under `strategy` ("plain": a hand-written loop), in this process."""
    torch.manual_seed(0)
    x, y = torch.randn(ONE_DEVICE_SAMPLES, 2048), torch.randint(0, 10, (ONE_DEVICE_SAMPLES,))
    sizes = [2048, 4096, 4096, 2048, 10]
    layers = [layer for i in range(4) for layer in (torch.nn.Linear(sizes[i], sizes[i + 1]), torch.nn.ReLU())]
    net = torch.nn.Sequential(*layers[:-1])
    with PeakAllocated(device) as peak:
        if strategy == "plain":
            net.to(device)
            optimizer = torch.optim.Adam(net.parameters(), lr=1e-4)
            for start in range(0, ONE_DEVICE_SAMPLES, ONE_DEVICE_BATCH):
                optimizer.zero_grad()
                torch.nn.functional.cross_entropy(net(x[start:start + ONE_DEVICE_BATCH].to(device)),
                                                  y[start:start + ONE_DEVICE_BATCH].to(device)).backward()
                optimizer.step()
        else:
            backend = easyfit.strategies.DDP(process_group_backend="nccl") \
                if strategy == "ddp" and device == "cuda" else strategy
            model = easyfit.Model(net, "cross_entropy", torch.optim.Adam(net.parameters(), lr=1e-4))
            model.fit(x, y, batch_size=ONE_DEVICE_BATCH, epochs=1, verbose=0, accelerator=device, devices=1,
                      strategy=backend)
    return peak.bytes


def one_device_main(strategies: list[str], device: str) -> None:
    """Each strategy in a fresh interpreter (a backend's buffers and caches must not count for the next)."""
    def measured(name: str) -> float:
        done = subprocess.run([sys.executable, __file__, "--one", name, "--device", device], capture_output=True,
                              text=True)
        if done.returncode:
            print(f"{name}: failed\n{done.stderr[-3000:]}")
            return float("nan")
        return json.loads(done.stdout.strip().splitlines()[-1])["peak"]
    plain = measured("plain")
    where = torch.cuda.get_device_name() if device == "cuda" else \
        "CPU (bytes allocated from the start of the fit: the net's own weights are not counted; the bars are for a GPU)"
    print(f"{where}; peak {device} memory of one epoch, 33.6 M-parameter MLP, Adam, batch 256")
    print(f"{'plain (hand-written loop)':28s} {plain / 1e6:9.0f} MB  1.00x")
    for name in strategies:
        if not available(name):
            continue
        peak = measured(name)
        bar = CUDA_BARS.get(name) if device == "cuda" else None
        verdict = "" if bar is None else f"  (bar {bar:.2f}x: {'ok' if peak / plain <= bar else 'OVER'})"
        print(f"{name:28s} {peak / 1e6:9.0f} MB  {peak / plain:4.2f}x{verdict}")


def pipeline(steps: int) -> None:
    """Each stage's training state against the whole net's, on 2 stages."""
    net = blocks()
    whole = estimate(net, torch.optim.Adam(net.parameters())).total
    rows = measure("pipeline", steps, net)
    if easyfit.distributed.environments.launch_identity()[0] != 0:
        return
    share = 1 / len(rows)
    print(f"whole net: parameters + gradients + Adam state = {whole / 1e6:.2f} MB; each stage's share {share:.0%}")
    print(f"{'stage':>5s} {'parameters':>11s} {'gradients':>11s} {'optimizer':>11s} {'total':>11s} {'of whole':>9s}")
    for stage, row in enumerate(rows):
        total = float(row[:3].sum())
        verdict = "ok" if total <= (share + 0.1) * whole else "OVER share + 10 %"
        print(f"{stage:5d} " + " ".join(f"{float(row[i]) / 1e6:8.2f} MB" for i in range(3))
              + f" {total / 1e6:8.2f} MB {total / whole:8.1%}  {verdict}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--strategies", default=None)
    parser.add_argument("--cuda", action="store_true", help="peak memory on one CUDA GPU against plain PyTorch")
    parser.add_argument("--cpu-allocated", action="store_true",
                        help="the same on the CPU, devices=1: the bytes torch allocates, as the profiler records them")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    parser.add_argument("--device", default="cuda", help=argparse.SUPPRESS)
    parser.add_argument("--pipeline", action="store_true", help="each pipeline stage's bytes against the whole net")
    args = parser.parse_args()
    if args.one:
        print(json.dumps({"peak": one_device_peak(args.one, args.device)}))
        return
    if args.cuda or args.cpu_allocated:
        strategies = (args.strategies or ",".join(ONE_DEVICE_STRATEGIES)).split(",")
        one_device_main(strategies, "cuda" if args.cuda else "cpu")
        return
    torch.set_num_threads(1)
    if args.pipeline:
        return pipeline(args.steps)
    args.strategies = args.strategies or ",".join(STRATEGIES)
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
