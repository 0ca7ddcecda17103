"""Fits with LR schedules under linear LR scaling on 2 ranks, one after the other in one launch (see lr_space.py).

Usage: python lr_schedules.py OUT_DIR STRATEGY DRAWS SEED
Rank 0 writes OUT_DIR/result.pt: {"schedules": {name: record}, "draws": [(config, record)], "compiled": (config,
record) or None}: one fit per schedule (no accumulation, clipping or weights), then DRAWS configurations drawn with
SEED; under ddp also a compiled fit (compile=, torch's aot_eager backend) and a fit resumed mid-epoch ("resumed").
"""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from lr_space import COMPILED, SCHEDULES, draw, fit, resumed


def main() -> None:
    out, strategy, draws, seed = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    torch.set_num_threads(1)
    run = {"devices": 2, "accelerator": "cpu", "strategy": strategy}
    plain = {"accumulate": 1, "clip": None, "weighted": False}
    schedules = {name: fit({"schedule": name, **plain}, run) for name in SCHEDULES}
    drawn = [(config, fit(config, run)) for config in draw(draws, seed)]
    compiled = resume = None
    if strategy == "ddp":
        compiled = (COMPILED, fit({**COMPILED, "compile": True}, run))   # the LRs are the compiled step's inputs
        resume = resumed({"schedule": "LambdaLR", **plain}, run, out)
    if int(os.environ.get("RANK", 0)) == 0:
        torch.save({"schedules": schedules, "draws": drawn, "compiled": compiled, "resumed": resume},
                   os.path.join(out, "result.pt"))


if __name__ == "__main__":
    main()
