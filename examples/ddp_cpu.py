"""Data-parallel training on 2 CPU processes (gloo), with no change to the training code.

Run:  python examples/ddp_cpu.py                       # strategy="ddp"
      python examples/ddp_cpu.py --strategy ddp_spawn

Each process trains on half of every global batch: batch_size=16 per process makes an effective batch of
32, and the learning rate is scaled by 2 (lr_scaling="linear", the default); the run summary line says so.

Where the code runs:
- strategy="ddp" re-runs this whole script once per extra rank (this process is rank 0). Every rank executes
  the top-level code, reaches the same `fit` call and joins the process group there, so the script would work
  even without the `if __name__ == "__main__":` guard. Code after `fit` also runs in every rank.
- strategy="ddp_spawn" starts the ranks with torch.multiprocessing, which imports this module in each child:
  the `if __name__ == "__main__":` guard is REQUIRED, or each child would start training again. Only the caller
  continues after `fit`; its `net` holds the trained weights and it gets the History.
Write scripts with the guard and both strategies work.
"""
from __future__ import annotations

import argparse

import torch
from quickstart import load_data
from torch import nn

import easyfit


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategy", default="ddp", choices=["ddp", "ddp_spawn"])
    parser.add_argument("--epochs", type=int, default=10)
    args = parser.parse_args()

    torch.manual_seed(0)   # the same initial weights in every rank (DDP also broadcasts rank 0's)
    x_train, x_test, y_train, y_test = load_data()
    net = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    model = easyfit.Model(net, "cross_entropy", "sgd", metrics=["accuracy"], lr=0.05)

    model.fit(x_train, y_train, epochs=args.epochs, batch_size=16, verbose=2,
              devices=2, accelerator="cpu", strategy=args.strategy)
    # evaluation is exact on several processes: each sample is counted once
    scores = model.evaluate(x_test, y_test, verbose=0, return_dict=True, devices=2, accelerator="cpu",
                            strategy=args.strategy)
    if model.is_global_zero:   # with "ddp" this line runs in every rank: print once
        print(f"{args.strategy}: test accuracy {scores['accuracy']:.4f}")


if __name__ == "__main__":   # required for ddp_spawn, harmless for ddp
    main()
