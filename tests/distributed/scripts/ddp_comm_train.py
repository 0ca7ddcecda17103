"""DDP communication options test program, run as `python ddp_comm_train.py OUT CASE [CASE ...]`; easyfit re-runs it
for rank 1, and both ranks run every case, one after the other (starting the ranks is most of a case's cost).

Each case (CASES) trains the shared net with SGD on 2 CPU processes (gloo) under DDPStrategy(comm_hook=...,
model_averaging_period=...) for its epochs, straight, or (resume) straight and then as 1 epoch (saved by
ModelCheckpoint to OUT/<case>-epoch1.pt) + a resumed fit. Every rank writes OUT/<case>-rank-<r>.pt: its final weights,
its flattened parameters after every optimizer step of the last fit, and the history; with resume also the straight
fit's final weights ("straight").
"""
import argparse
import os
import sys

import torch

import easyfit
from easyfit.callbacks import Callback, ModelCheckpoint
from easyfit.distributed.strategies.ddp import DDPStrategy

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import make_data, make_net

LR = 0.1


class Snapshots(Callback):
    """This rank's parameters, flattened, after every training step."""

    def __init__(self):
        self.parameters = []

    def on_train_batch_end(self, batch, logs=None):
        self.parameters.append(torch.cat([p.detach().flatten().clone() for p in self.model.net.parameters()]))


#: each case's strategy options, epochs and whether it also resumes from a 1-epoch checkpoint
CASES = {
    "fp16": ({"comm_hook": "fp16"}, 2, False),
    "powersgd": ({"comm_hook": "powersgd"}, 4, True),
    "averaging": ({"model_averaging_period": 3}, 2, False),
    "averaging_resumed": ({"model_averaging_period": 3}, 2, True),
    "averaging_warmup": ({"model_averaging_period": 3, "model_averaging_warmup": 6}, 2, True),
}


def run_case(out: str, case: str) -> None:
    options, epochs, resume = CASES[case]
    x, y = make_data()
    strategy = DDPStrategy(powersgd_start_step=2, **options)

    def new_model() -> easyfit.Model:
        net = make_net()
        return easyfit.Model(net, "cross_entropy", torch.optim.SGD(net.parameters(), lr=LR))

    fit = dict(batch_size=16, shuffle=False, verbose=0, lr_scaling=None, devices=2, accelerator="cpu",
               strategy=strategy)
    model, snapshots = new_model(), Snapshots()
    found = {}
    if resume:   # the checkpoint is written inside fit, where it holds the strategy's full optimizer state
        model.fit(x, y, epochs=epochs, **fit)
        found["straight"] = model.net.state_dict()
        model = new_model()
        checkpoint = os.path.join(out, f"{case}-epoch1.pt")
        model.fit(x, y, epochs=1, callbacks=[ModelCheckpoint(checkpoint)], **fit)
        model = new_model()
        model.fit(x, y, epochs=epochs, resume_from=checkpoint, callbacks=[snapshots], **fit)
    else:
        model.fit(x, y, epochs=epochs, callbacks=[snapshots], **fit)
    torch.save({"state": model.net.state_dict(), "snapshots": snapshots.parameters,
                "history": dict(model.history.history), **found},
               os.path.join(out, f"{case}-rank-{model.global_rank}.pt"))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("cases", nargs="+", choices=sorted(CASES))
    args = parser.parse_args()
    torch.set_num_threads(1)
    for case in args.cases:
        run_case(args.out, case)


if __name__ == "__main__":
    main()
