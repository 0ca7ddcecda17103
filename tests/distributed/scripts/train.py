"""A training script run as a real program by the distributed tests (each rank runs it or a copy of it).

Usage: python train.py OUT_DIR STRATEGY [--lr 0.05] [--lr-scaling linear|none]
                                        [--fail-rank R --fail-step S --fail-mode raise|kill|hang]
                                        [--num-nodes N] [--devices D] [--epochs E] [--then-linear LR]
Rank 0 writes OUT_DIR/result.pt: trained weights, history, evaluate() and predict() results; with --then-linear, also
those of a second fit of a new Model at LR with linear LR scaling, after the first (under "linear").
"""
import argparse
import os
import signal
import sys
import time

import torch

import easyfit
from easyfit.callbacks import Callback
from easyfit.distributed.launchers import RankFailedError

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import make_data, make_net


class FailAt(Callback):
    """On one rank at one step: raise, die by SIGKILL, or hang, to test that every rank stops."""

    def __init__(self, rank: int, step: int, mode: str):
        self.rank, self.step, self.mode = rank, step, mode

    def on_train_batch_end(self, batch, logs=None):
        if self.model.global_rank != self.rank or batch != self.step:
            return
        print(f"FAILING_AT {time.time()}", file=sys.stderr, flush=True)
        if self.mode == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if self.mode == "hang":
            time.sleep(3600)
        raise RuntimeError(f"deliberate failure on rank {self.rank} at step {self.step}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("strategy")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--lr-scaling", default="none")
    parser.add_argument("--fail-rank", type=int, default=-1)
    parser.add_argument("--fail-step", type=int, default=3)
    parser.add_argument("--fail-mode", choices=("raise", "kill", "hang"), default="raise")
    parser.add_argument("--num-nodes", type=int, default=1)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--fail-before-fit", type=int, default=-1, help="this local rank raises before calling fit")
    parser.add_argument("--retry-after-failure", action="store_true", help="catch a rank failure and fit again")
    parser.add_argument("--then-linear", type=float, default=None,
                        help="then fit a new Model at this LR with linear LR scaling")
    args = parser.parse_args()
    if int(os.environ.get("LOCAL_RANK", 0)) == args.fail_before_fit:
        print(f"FAILING_AT {time.time()}", file=sys.stderr, flush=True)
        raise RuntimeError(f"deliberate failure before fit on local rank {args.fail_before_fit}")
    torch.set_num_threads(1)
    x, y = make_data()
    net = make_net()
    model = easyfit.Model(net, "cross_entropy", torch.optim.SGD(net.parameters(), lr=args.lr), metrics=["accuracy"])
    callbacks = [FailAt(args.fail_rank, args.fail_step, args.fail_mode)] if args.fail_rank >= 0 else []
    run = dict(devices=args.devices, accelerator="cpu", strategy=args.strategy, num_nodes=args.num_nodes)
    lr_scaling = None if args.lr_scaling == "none" else args.lr_scaling
    try:
        history = model.fit(x, y, epochs=args.epochs, batch_size=16, shuffle=False, verbose=0, callbacks=callbacks,
                            lr_scaling=lr_scaling, **run)
    except RankFailedError:
        if not args.retry_after_failure:
            raise
        history = model.fit(x, y, epochs=args.epochs, batch_size=16, verbose=0, lr_scaling=lr_scaling, **run)
    x_eval, y_eval = x[:101], y[:101]
    scores = model.evaluate(x_eval, y_eval, batch_size=8, verbose=0, **run, return_dict=True)
    predictions = model.predict(x_eval, batch_size=8, **run)
    # a one-process call after a multi-process one stays local (no sync over the still-open process group)
    local_scores = model.evaluate(x_eval, y_eval, batch_size=8, verbose=0, return_dict=True, strategy="single",
                                  accelerator="cpu")
    linear = None if args.then_linear is None else fit_linear(args.then_linear, x, y, run, args.epochs)
    if model.is_global_zero:   # saving from rank 0 alone must not wait for the other ranks
        model.save(os.path.join(args.out, "checkpoint.pt"))
        torch.save({**outcome(net, model, history), "scores": scores, "local_scores": local_scores,
                    "predictions": predictions, "world_size": history.params["world_size"], "linear": linear},
                   os.path.join(args.out, "result.pt"))


def outcome(net: torch.nn.Module, model: easyfit.Model, history) -> dict:
    """What the caller got back: the weights in its own net, the History and the LR its optimizer has after fit."""
    return {"state": net.state_dict(), "history": history.history, "params": history.params,
            "lr_after": [g["lr"] for g in model.optimizer.param_groups]}


def fit_linear(lr: float, x, y, run: dict, epochs: int) -> dict:
    """A new Model at `lr`, fitted with linear LR scaling (as a script that trains a second model does)."""
    net = make_net()
    model = easyfit.Model(net, "cross_entropy", torch.optim.SGD(net.parameters(), lr=lr))
    history = model.fit(x, y, epochs=epochs, batch_size=16, shuffle=False, verbose=0, lr_scaling="linear", **run)
    return outcome(net, model, history)


if __name__ == "__main__":
    main()
