"""DDP communication options test program, run as `python ddp_comm_train.py OUT ...`; easyfit re-runs it for rank 1.

Trains the shared net with SGD on 2 CPU processes (gloo) under DDPStrategy(comm_hook=..., model_averaging_period=...)
for EPOCHS epochs, straight, or (--resume) straight and then as 1 epoch (saved by ModelCheckpoint) + a resumed fit.
Every rank writes OUT/rank-<r>.pt: its final weights, its flattened parameters after every optimizer step of the last
fit, and the history; with --resume also the straight fit's final weights ("straight").
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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--comm-hook", default=None)
    parser.add_argument("--period", type=int, default=None)
    parser.add_argument("--warmup", type=int, default=0, help="model_averaging_warmup")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--resume", action="store_true",
                        help="also 1 epoch, save, then resume up to --epochs, after the straight fit")
    args = parser.parse_args()
    torch.set_num_threads(1)
    x, y = make_data()
    strategy = DDPStrategy(comm_hook=args.comm_hook, powersgd_start_step=2, model_averaging_period=args.period,
                           model_averaging_warmup=args.warmup)

    def new_model() -> easyfit.Model:
        net = make_net()
        return easyfit.Model(net, "cross_entropy", torch.optim.SGD(net.parameters(), lr=LR))

    fit = dict(batch_size=16, shuffle=False, verbose=0, lr_scaling=None, devices=2, accelerator="cpu",
               strategy=strategy)
    model, snapshots = new_model(), Snapshots()
    found = {}
    if args.resume:   # the checkpoint is written inside fit, where it holds the strategy's full optimizer state
        model.fit(x, y, epochs=args.epochs, **fit)
        found["straight"] = model.net.state_dict()
        model = new_model()
        checkpoint = os.path.join(args.out, "epoch1.pt")
        model.fit(x, y, epochs=1, callbacks=[ModelCheckpoint(checkpoint)], **fit)
        model = new_model()
        model.fit(x, y, epochs=args.epochs, resume_from=checkpoint, callbacks=[snapshots], **fit)
    else:
        model.fit(x, y, epochs=args.epochs, callbacks=[snapshots], **fit)
    torch.save({"state": model.net.state_dict(), "snapshots": snapshots.parameters,
                "history": dict(model.history.history), **found},
               os.path.join(args.out, f"rank-{model.global_rank}.pt"))


if __name__ == "__main__":
    main()
