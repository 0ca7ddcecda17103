"""Per-step time on one CUDA GPU with the data already in GPU memory: the hand-written eager loop against easyfit,
eager and (with --compile) fit(compile=MODE) for each comma-separated MODE ("True", "reduce-overhead"; default
True). Each side runs in its own process; the sides are interleaved in rounds.

    python benchmarks/gpu_steps.py [--compile [MODES]] [--rounds 3] [--epochs 3] [--workloads mlp,resnet]
                                   [--sides hand,easyfit,...] [--device cuda]

The workloads are benchmarks/gpu.py's (MLP 784-512-512-10, 60,000 samples, batch 128, Adam, fp32; ResNet-18 on
32x32 images, batch 256, SGD, bf16-mixed, when torchvision is installed), moved to the GPU once, so a step is only
its own work: indexing a shuffled batch, forward, loss, backward and optimizer step. Every process trains one
warm-up epoch (which includes any compilation) and then `--epochs` timed epochs, CUDA synchronised at both ends.
The table gives each side's median seconds per step over rounds and its speed-up over the hand-written loop (the
median over rounds of hand / side). Bars for easyfit-compiled: at least 2x on the MLP, 1.15x on ResNet-18.

To add a side, write `run_<side>(name, epochs, device, samples) -> [seconds per step of each timed epoch]` and add it to
RUNNERS (and to DEFAULT_SIDES to run it by default). `--device cpu` runs a smoke test without a GPU.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import subprocess
import sys

import torch
import torch.nn.functional as F
from gpu import EpochClock, interleaved, make_optimizer, workload

DEFAULT_SIDES = ["hand", "easyfit"]
BARS = {("mlp", "compiled"): 2.0, ("resnet", "compiled"): 1.15}   # speed-up over hand-written, any compile mode


def on_device(name: str, device: torch.device, samples: int | None):
    """The workload with its net and data on `device` (the first `samples` samples, when given)."""
    net, x, y, batch_size, precision = workload(name)
    samples = samples or len(x)
    return net.to(device), x[:samples].to(device), y[:samples].to(device), batch_size, precision


def run_hand(name: str, epochs: int, device: torch.device, samples: int | None) -> list[float]:
    net, x, y, batch_size, precision = on_device(name, device, samples)
    optimizer = make_optimizer(name, net)
    dtype = torch.bfloat16 if precision == "bf16-mixed" else None
    clock = EpochClock(-(-len(x) // batch_size), device)
    for _ in range(epochs + 1):
        clock.start()
        order = torch.randperm(len(x), device=device)
        for start in range(0, len(x), batch_size):
            index = order[start:start + batch_size]
            optimizer.zero_grad(set_to_none=True)
            with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
                loss = F.cross_entropy(net(x[index]), y[index])
            loss.backward()
            optimizer.step()
        clock.stop()
    return clock.times[1:]


def run_easyfit(name: str, epochs: int, mode, device: torch.device, samples: int | None) -> list[float]:
    """easyfit's fit; compiled with `mode` unless it is False."""
    import easyfit
    from easyfit.callbacks import LambdaCallback
    net, x, y, batch_size, precision = on_device(name, device, samples)
    clock = EpochClock(-(-len(x) // batch_size), device)
    timer = LambdaCallback(on_epoch_begin=lambda epoch, logs: clock.start(),
                           on_epoch_end=lambda epoch, logs: clock.stop())
    easyfit.Model(net, "cross_entropy", make_optimizer(name, net)).fit(
        x, y, epochs=epochs + 1, batch_size=batch_size, verbose=0, accelerator=device.type, devices=1,
        precision=precision, callbacks=[timer], compile=mode)
    return clock.times[1:]


RUNNERS = {
    "hand": run_hand,
    "easyfit": lambda name, epochs, device, samples: run_easyfit(name, epochs, False, device, samples),
}


def compile_mode(side: str):
    """The compile= value of a side "easyfit-compiled[MODE]" ("True" is True)."""
    mode = side[len("easyfit-compiled["):-1]
    return True if mode == "True" else mode


def run_side(side: str, name: str, epochs: int, device: torch.device, samples: int | None) -> list[float]:
    if side.startswith("easyfit-compiled["):
        return run_easyfit(name, epochs, compile_mode(side), device, samples)
    return RUNNERS[side](name, epochs, device, samples)


def measure(side: str, name: str, args) -> float:
    """The median seconds per step of `side` on workload `name`, in a fresh process."""
    command = [sys.executable, __file__, "--worker", side, "--workloads", name, "--epochs", str(args.epochs),
               "--device", args.device]
    if args.samples:
        command += ["--samples", str(args.samples)]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"{side} on {name} failed:\n{done.stderr[-3000:]}")
    return statistics.median(json.loads(done.stdout.strip().splitlines()[-1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--compile", nargs="?", const="True", default=None,
                        help="add a side fit(compile=MODE) for each of the comma-separated MODEs (True, "
                             "reduce-overhead, ...; default True)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--workloads", default="mlp,resnet")
    parser.add_argument("--sides", default=None, help="comma-separated sides (default: hand, easyfit, and "
                                                      "easyfit-compiled with --compile)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--samples", type=int, default=None, help="train on the first SAMPLES samples only")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    device = torch.device(args.device)
    if args.worker:
        print(json.dumps(run_side(args.worker, args.workloads, args.epochs, device, args.samples)))
        return
    compiled = [f"easyfit-compiled[{mode}]" for mode in args.compile.split(",")] if args.compile else []
    sides = args.sides.split(",") if args.sides else DEFAULT_SIDES + compiled
    names = [name for name in args.workloads.split(",")
             if name != "resnet" or importlib.util.find_spec("torchvision")]
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else args.device
    print(f"{where}, torch {torch.__version__}, data in device memory; seconds per step, median of {args.rounds} "
          f"rounds x {args.epochs} epochs; speed-up over the hand-written loop (compile={args.compile!r})")
    for name in names:
        times = interleaved(sides, args.rounds, lambda side, name=name: measure(side, name, args))
        for side in sides:
            speedups = [h / t for t, h in zip(times[side], times["hand"])]
            bar = BARS.get((name, "compiled" if side.startswith("easyfit-compiled[") else side))
            verdict = f"  (bar {bar:.2f}x: {'ok' if statistics.median(speedups) >= bar else 'UNDER'})" if bar else ""
            print(f"{name:7s} {side:33s} {statistics.median(times[side]) * 1e3:8.3f} ms  "
                  f"{statistics.median(speedups):5.2f}x (per round {min(speedups):.2f}-{max(speedups):.2f}){verdict}")


if __name__ == "__main__":
    main()
