"""2-process CPU DDP: easyfit's throughput and start-up time against a hand-written torchrun + DDP script.

    python benchmarks/ddp.py [--steps N] [--repeats R] [--warmup W] [--steps-per-epoch S]

Both sides train the compute-bound MLP 784-1024-1024-10 with SGD, batch 128 per process, one torch thread per
process, over gloo, for the same number of steps on the same in-memory data (benchmarks/ddp_workers/):
  hand     python -m torch.distributed.run --nproc-per-node 2 hand.py     (DDP, x[idx] batches of a per-rank shard)
  easyfit  python easyfit_run.py                                           (model.fit(..., devices=2, strategy="ddp"))
Runs alternate (hand, easyfit, hand, ...) so that a change in machine load hits both alike; medians are reported.

throughput: samples/s over both processes, timed on rank 0 from step W to the end of training.
first step: seconds from the moment this script launched the command to rank 0 beginning its first step.
Bars: easyfit throughput >= 0.98 × hand-written; start to first step within 0.5 s of it in every run (each
easyfit run is compared with the hand-written run just before it).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from easyfit.distributed.environments import find_free_port

WORKERS = Path(__file__).resolve().parent / "ddp_workers"
PROCESSES = 2
BAR = 0.98
START_BAR = 0.5   # seconds easyfit's start to the first step may trail the hand-written one's, in every run


def command(side: str, out: Path, epochs: int, steps_per_epoch: int, warmup: int) -> list[str]:
    arguments = [str(out), "--epochs", str(epochs), "--steps-per-epoch", str(steps_per_epoch),
                 "--warmup", str(warmup)]
    if side == "easyfit":
        return [sys.executable, str(WORKERS / "easyfit_run.py"), *arguments]
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(PROCESSES),
            "--master-port", str(find_free_port()), str(WORKERS / "hand.py"), *arguments]


def run(side: str, epochs: int, steps_per_epoch: int, warmup: int, timeout: float) -> dict:
    """Run one side once; its rank 0 timings plus the seconds from launch to its first step."""
    with tempfile.TemporaryDirectory(prefix="easyfit-bench-ddp-") as folder:
        out = Path(folder) / "result.json"
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        launched = time.time()
        finished = subprocess.run(command(side, out, epochs, steps_per_epoch, warmup), env=env, cwd=WORKERS,
                                  capture_output=True, text=True, timeout=timeout)
        if finished.returncode != 0 or not out.exists():
            raise RuntimeError(f"the {side} run failed (exit code {finished.returncode}):\n"
                               f"{finished.stdout[-3000:]}\n{finished.stderr[-3000:]}")
        result = json.loads(out.read_text())
    result["start_to_first_step"] = result.pop("first_step") - launched
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300, help="optimizer steps per process (rounded up to whole "
                                                                "epochs)")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each side, alternating")
    parser.add_argument("--warmup", type=int, default=20, help="first steps left out of the throughput")
    parser.add_argument("--steps-per-epoch", type=int, default=50, help="batches per process in one epoch")
    parser.add_argument("--timeout", type=float, default=600, help="seconds one run may take")
    args = parser.parse_args()
    epochs = math.ceil(args.steps / args.steps_per_epoch)
    steps = epochs * args.steps_per_epoch
    if not 0 <= args.warmup < steps:
        parser.error(f"--warmup must be between 0 and the number of steps ({steps})")
    print(f"{PROCESSES} processes × batch 128, MLP 784-1024-1024-10, SGD, gloo, 1 thread per process; "
          f"{steps} steps ({epochs} epochs × {args.steps_per_epoch}), first {args.warmup} untimed; "
          f"{args.repeats} runs per side")
    results: dict[str, list[dict]] = {"hand": [], "easyfit": []}
    for repeat in range(args.repeats):
        for side in results:
            result = run(side, epochs, args.steps_per_epoch, args.warmup, args.timeout)
            results[side].append(result)
            print(f"  run {repeat + 1} {side:8s} {result['samples_per_second']:9.1f} samples/s   "
                  f"first step after {result['start_to_first_step']:.2f} s", flush=True)
    report(results)


def report(results: dict[str, list[dict]]) -> None:
    median = {side: {key: statistics.median(r[key] for r in runs) for key in ("samples_per_second",
                                                                              "start_to_first_step")}
              for side, runs in results.items()}
    print(f"\n{'':10s}{'samples/s':>12s}{'start → first step':>22s}")
    for side, values in median.items():
        print(f"{side:10s}{values['samples_per_second']:12.1f}{values['start_to_first_step']:20.2f} s")
    ratio = median["easyfit"]["samples_per_second"] / median["hand"]["samples_per_second"]
    verdict = "meets" if ratio >= BAR else "BELOW"
    ratios = [e["samples_per_second"] / h["samples_per_second"] for e, h in zip(results["easyfit"], results["hand"])]
    print(f"\nthroughput easyfit / hand-written: {ratio:.3f} ({verdict} the bar of >= {BAR}); per-run ratios: "
          f"median {statistics.median(ratios):.3f}, {min(ratios):.3f} to {max(ratios):.3f}")
    behind = [e["start_to_first_step"] - h["start_to_first_step"] for e, h in zip(results["easyfit"],
                                                                                  results["hand"])]
    verdict = "within" if max(behind) <= START_BAR else "NOT within"
    print(f"start → first step, easyfit - hand-written: median "
          f"{median['easyfit']['start_to_first_step'] - median['hand']['start_to_first_step']:+.2f} s; per run "
          f"{min(behind):+.2f} to {max(behind):+.2f} s ({verdict} {START_BAR} s in every run)")


if __name__ == "__main__":
    main()
