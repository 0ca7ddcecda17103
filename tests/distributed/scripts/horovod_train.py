"""Horovod test program: run as `python horovod_train.py OUT ...` (ranks from horovod.run) or under
`horovodrun --gloo -np 2 -H localhost:2 python horovod_train.py OUT ...` (every rank runs it).

It trains the shared net with Adam and a per-epoch StepLR for 2 epochs, straight or as 1 epoch + a resumed epoch
from a checkpoint, then evaluates and predicts (not with --fits-only: each call under horovod.run starts its ranks anew,
which is what costs time here). Rank 0 writes OUT/result.pt; under horovodrun every rank also writes OUT/rank-<r>.pt
with its final weights.
"""
import argparse
import os
import sys

import torch

import easyfit

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import make_data, make_net

LR, GAMMA = 0.01, 0.5


def new_model() -> easyfit.Model:
    net = make_net()
    optimizer = torch.optim.Adam(net.parameters(), lr=LR)
    return easyfit.Model(net, "cross_entropy", optimizer, metrics=["accuracy"],
                         scheduler=torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=GAMMA))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--accumulate", type=int, default=1)
    parser.add_argument("--resume", action="store_true", help="train 1 epoch, save, and resume for the 2nd")
    parser.add_argument("--fits-only", action="store_true", help="neither evaluate nor predict after the fit")
    args = parser.parse_args()
    torch.set_num_threads(1)
    x, y = make_data()
    run = dict(devices=2, accelerator="cpu", strategy="horovod")
    fit = dict(batch_size=16, shuffle=False, verbose=0, lr_scaling=None,
               gradient_accumulation_steps=args.accumulate, **run)
    model = new_model()
    if args.resume:
        model.fit(x, y, epochs=1, **fit)
        checkpoint = os.path.join(args.out, "epoch1.pt")
        model.save(checkpoint)   # every rank may call it after fit: only rank 0 writes
        model = new_model()
        model.fit(x, y, epochs=2, resume_from=checkpoint, **fit)
    else:
        model.fit(x, y, epochs=2, **fit)
    scores, predictions = None, None
    if not args.fits_only:
        scores = model.evaluate(x[:101], y[:101], batch_size=8, verbose=0, **run, return_dict=True)
        predictions = model.predict(x[:101], batch_size=8, **run)
    rank = int(os.environ.get("HOROVOD_RANK", 0))
    if "HOROVOD_RANK" in os.environ:
        torch.save(model.net.state_dict(), os.path.join(args.out, f"rank-{rank}.pt"))
    if model.is_global_zero:
        model.save(os.path.join(args.out, "checkpoint.pt"))
        torch.save({"state": model.net.state_dict(), "history": dict(model.history.history), "scores": scores,
                    "predictions": predictions, "params": model.history.params,
                    "optimizer": model.optimizer.state_dict(), "lr_after": model.optimizer.param_groups[0]["lr"]},
                   os.path.join(args.out, "result.pt"))


if __name__ == "__main__":
    main()
