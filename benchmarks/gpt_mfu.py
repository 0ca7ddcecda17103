"""MFU of a compiled GPT-2-small-sized causal LM step: easyfit's fit(compile=True) with ThroughputMonitor against a
hand-written loop over torch.compile(net), each side in its own process, on one GPU.

    python benchmarks/gpt_mfu.py [--steps 30] [--batch-size 8] [--length 1024] [--device cuda] [--small] [--profile]

The net is transformers' GPT2LMHeadModel with GPT-2 small's shape (124 M parameters, randomly initialised, nothing
downloaded), trained in bf16-mixed with AdamW on random tokens held in device memory, with the model's own loss
(loss="model"). Each side trains one warm-up epoch of `--steps` steps (compilation included) and one timed epoch.
The hand-written side's MFU is the FLOPs of one step (counted by torch.utils.flop_counter on an eager step) over its
step time and the GPU's peak from easyfit's table; easyfit's is ThroughputMonitor's `mfu` of the timed epoch.
The bar: easyfit's MFU within 3 % of the hand-written loop's. `--small` (a 2-layer net) with `--device cpu` is a
smoke test without a GPU. `--profile` runs each side's timed epoch under torch.profiler and prints, per side, the
device's busy time per step beside the step time, and the kernels that take the most device time.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
import sys
import time
import warnings

import torch

BAR = 0.03   # easyfit's MFU may be at most this share below the hand-written loop's


def gpt(small: bool):
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_embd=128, n_head=4) if small else GPT2Config()
    return GPT2LMHeadModel(config)


def tokens(args) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1)
    return torch.randint(0, 50257, (args.steps * args.batch_size, args.length), generator=generator)


def peak(device: torch.device) -> float:
    from easyfit.callbacks.throughput import peak_flops
    return peak_flops(device, "bf16-mixed") or 1e12   # a CPU smoke test: any positive figure


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class EpochProfile:
    """torch.profiler around one epoch, if asked for: the device's busy time per step and the busiest kernels."""

    def __init__(self, wanted: bool, steps: int):
        self.steps = steps
        self.profiler = torch.profiler.profile() if wanted else None

    def __enter__(self):
        if self.profiler is not None:
            self.profiler.__enter__()
        return self

    def __exit__(self, *exc):
        if self.profiler is not None:
            self.profiler.__exit__(*exc)

    def report(self) -> dict:
        if self.profiler is None:
            return {}
        averages = self.profiler.key_averages()
        busy = sum(getattr(event, "self_device_time_total", 0) for event in averages) / self.steps / 1e3
        table = averages.table(sort_by="self_device_time_total", row_limit=15, max_name_column_width=70)
        return {"busy_ms_per_step": busy, "profile": table}


def run_hand(args, device: torch.device) -> dict:
    from torch.utils.flop_counter import FlopCounterMode
    net = gpt(args.small).to(device)
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-4)
    data = tokens(args).to(device)

    def step(model, batch):
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = model(batch, labels=batch).loss
        loss.backward()
        optimizer.step()

    counter = FlopCounterMode(display=False)
    with counter:
        step(net, data[:args.batch_size])
    compiled = torch.compile(net)
    seconds, profile = [], EpochProfile(args.profile, args.steps)
    for epoch in range(2):   # a warm-up epoch, then the timed one
        synchronize(device)
        started = time.perf_counter()
        with profile if epoch else contextlib.nullcontext():
            for start in range(0, len(data), args.batch_size):
                step(compiled, data[start:start + args.batch_size])
            synchronize(device)
        seconds.append((time.perf_counter() - started) / args.steps)
    return {"step_time": seconds[-1], "mfu": counter.get_total_flops() / seconds[-1] / peak(device),
            **profile.report()}


def run_easyfit(args, device: torch.device) -> dict:
    import easyfit
    from easyfit.callbacks import LambdaCallback, ThroughputMonitor
    from easyfit.utils.torch_internals import compile_totals
    profile = EpochProfile(args.profile, args.steps)
    profiling = LambdaCallback(on_epoch_begin=lambda epoch, logs: epoch and profile.__enter__(),
                               on_epoch_end=lambda epoch, logs: epoch and profile.__exit__(None, None, None))
    net = gpt(args.small)
    data = tokens(args).to(device)
    model = easyfit.Model(net, "model", torch.optim.AdamW(net.parameters(), lr=1e-4))
    with warnings.catch_warnings(record=True) as notices:
        warnings.simplefilter("always", UserWarning)
        history = model.fit(data, data, epochs=2, batch_size=args.batch_size, shuffle=False, verbose=0,
                            accelerator="gpu" if device.type == "cuda" else "cpu", devices=1,
                            precision="bf16-mixed", compile=True,
                            callbacks=[ThroughputMonitor(peak_flops=None if device.type == "cuda" else peak(device)),
                                       profiling])
    said = sorted({str(notice.message)[:200] for notice in notices if "compile=" in str(notice.message)})
    return {"step_time": history.history["step_time"][-1], "mfu": history.history["mfu"][-1],
            "graphs": compile_totals()[0], "notices": said, **profile.report()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--length", type=int, default=1024)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--small", action="store_true")
    parser.add_argument("--profile", action="store_true", help="profile each side's timed epoch")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    device = torch.device(args.device)
    if args.worker:
        print(json.dumps({"hand": run_hand, "easyfit": run_easyfit}[args.worker](args, device)))
        return
    results = {}
    for side in ("hand", "easyfit"):
        done = subprocess.run([sys.executable, __file__, "--worker", side, *sys.argv[1:]], capture_output=True,
                              text=True)
        if done.returncode:
            raise RuntimeError(f"{side} failed:\n{done.stderr[-3000:]}")
        results[side] = json.loads(done.stdout.strip().splitlines()[-1])
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else args.device
    hand, ours = results["hand"]["mfu"], results["easyfit"]["mfu"]
    print(f"{where}, torch {torch.__version__}; GPT-2 {'(2 layers)' if args.small else 'small'}, batch "
          f"{args.batch_size} x {args.length} tokens, bf16-mixed, compiled")
    for side, result in results.items():
        busy = f"  device busy {result['busy_ms_per_step']:.2f} ms per step" if args.profile else ""
        print(f"{side:8s} {result['step_time'] * 1e3:8.2f} ms per step  MFU {result['mfu']:.3f}{busy}")
    print(f"easyfit compiled {results['easyfit']['graphs']} graphs; its notices: {results['easyfit']['notices']}")
    for side, result in results.items() if args.profile else ():
        print(f"{side}'s timed epoch, by device time:\n{result['profile']}")
    verdict = "ok" if ours >= hand * (1 - BAR) else "UNDER"
    print(f"easyfit's MFU / the hand-written loop's: {ours / hand:.3f} (bar {1 - BAR:.2f}: {verdict})")


if __name__ == "__main__":
    main()
