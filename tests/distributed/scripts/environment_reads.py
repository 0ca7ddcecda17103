"""The calls each rank of a 2-process ddp fit makes into easyfit/distributed/environments/ (the launch environment's
readers), counted with a profiler from the start of `Model.fit` to its end: after a first fit (which starts the
ranks), once for a fit of 1 epoch and once for a fit of 4 epochs (4 times the steps, the evaluations and the
questions about the ranks).

Usage: python environment_reads.py OUT_DIR
Each rank writes OUT_DIR/<rank>.json: {"1": calls in the 1-epoch fit, "4": calls in the 4-epoch fit}.
"""
import json
import os
import sys

import torch

import easyfit

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import make_data, make_net

ENVIRONMENTS = os.path.join(os.path.dirname(easyfit.__file__), "distributed", "environments")


def calls_into_environments(epochs: int) -> int:
    """The calls into the environments package during one fit of `epochs` epochs on 2 ranks."""
    calls = 0

    def profile(frame, event, arg) -> None:
        nonlocal calls
        if event == "call" and frame.f_code.co_filename.startswith(ENVIRONMENTS):
            calls += 1

    x, y = make_data()
    model = easyfit.Model(make_net(), "cross_entropy", "adam")
    sys.setprofile(profile)
    try:
        model.fit(x, y, batch_size=16, epochs=epochs, verbose=0, devices=2, accelerator="cpu", strategy="ddp",
                  validation_split=0.25)
    finally:
        sys.setprofile(None)
    return calls


def main() -> None:
    out = sys.argv[1]
    torch.set_num_threads(1)
    calls_into_environments(1)   # the ranks start
    counts = {epochs: calls_into_environments(epochs) for epochs in (1, 4)}
    with open(os.path.join(out, f"{int(os.environ.get('RANK', 0))}.json"), "w") as file:
        json.dump(counts, file)


if __name__ == "__main__":
    main()
