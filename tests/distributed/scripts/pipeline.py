"""The pipeline strategy as a real program: many checks in one launch (starting processes is what costs time).

Usage: python pipeline.py OUT_DIR CHECKS [--devices 2]
CHECKS is a comma-separated list of:
  parity      Adam, 2 epochs, batch 20 in 3 micro-batches (every batch leaves a rest micro-batch): gpipe and 1f1b,
              balance [2, 2] and "auto", with accumulation 2 and clipping 0.5, one plain case, and interleaved
              1F1B (2 stages per rank) (weights after fit)
  evaluate    after a fit with validation: the last epoch's val_loss / val_accuracy, and evaluate and predict on 2
              stages, on 101 samples in batches of 8 (the weights are in result too)
  groups      a first stage without parameters (balance [1, 3] on Tanh, Linear, Tanh, Linear) and an optimizer of
              two param groups with their own learning rates, one per stage: the largest weight difference from
              plain PyTorch, computed here
  resume      ModelCheckpoint after 2 of 4 epochs on 2 stages, resumed to 4 on 1 stage x 2 replicas, beside 4
              straight; and a rank-0-only save after fit
  mesh        (4 processes) 2 stages x 2 replicas, 2 epochs, against plain PyTorch, a resume after epoch 1 onto
              4 stages, and evaluate / predict on 2 stages x 2 replicas
Each rank writes OUT_DIR/<rank>.pt with what it measured.
"""
import argparse
import os
import sys

import torch

import easyfit
from easyfit.callbacks import ModelCheckpoint
from easyfit.distributed.environments import launch_identity
from easyfit.strategies import Pipeline

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import make_data, make_pipeline_net

LR = 0.01
PARITY_CASES = {   # name -> (Pipeline options, fit options)
    "gpipe_2_2": ({"balance": [2, 2], "checkpoint": "always"}, {"gradient_accumulation_steps": 2,
                                                                 "gradient_clip_val": 0.5}),
    "gpipe_auto": ({"balance": "auto"}, {"gradient_accumulation_steps": 2, "gradient_clip_val": 0.5}),
    "1f1b_2_2": ({"balance": [2, 2], "schedule": "1f1b"}, {"gradient_accumulation_steps": 2,
                                                            "gradient_clip_val": 0.5}),
    "1f1b_auto": ({"balance": "auto", "schedule": "1f1b", "checkpoint": "never"},
                  {"gradient_accumulation_steps": 2, "gradient_clip_val": 0.5}),
    "1f1b_plain": ({"schedule": "1f1b"}, {}),
    "interleaved_auto": ({"schedule": "interleaved_1f1b"}, {"gradient_accumulation_steps": 2,
                                                            "gradient_clip_val": 0.5}),
}


def fit(strategy, devices: int, batch_size: int = 20, epochs: int = 2, **options) -> easyfit.Model:
    x, y = make_data()
    net = make_pipeline_net()
    model = easyfit.Model(net, "cross_entropy", torch.optim.Adam(net.parameters(), lr=LR), metrics=["accuracy"])
    model.fit(x, y, batch_size=batch_size, epochs=epochs, shuffle=False, verbose=0, lr_scaling=None,
              devices=devices, accelerator="cpu", strategy=strategy, **options)
    return model


def parity(devices: int) -> dict:
    return {case: fit(Pipeline(microbatches=3, **strategy), devices, **options).net.state_dict()
            for case, (strategy, options) in PARITY_CASES.items()}


def evaluate(devices: int) -> dict:
    x, y = make_data()
    model = fit(Pipeline(microbatches=3), devices, validation_data=(x[:101], y[:101]), validation_batch_size=8)
    history = model.history.history
    options = {"batch_size": 8, "devices": devices, "accelerator": "cpu", "strategy": Pipeline(microbatches=3)}
    return {"weights": model.net.state_dict(), "val_loss": history["val_loss"][-1],
            "val_accuracy": history["val_accuracy"][-1],
            "scores": model.evaluate(x[:101], y[:101], verbose=0, return_dict=True, **options),
            "predictions": model.predict(x[:101], **options)}


def groups(devices: int) -> float:
    def make():
        torch.manual_seed(2)
        net = torch.nn.Sequential(torch.nn.Tanh(), torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
        return net, torch.optim.Adam([{"params": net[1].parameters(), "lr": 0.01},
                                      {"params": net[3].parameters(), "lr": 0.02}])
    x, y = make_data()
    net, optimizer = make()
    easyfit.Model(net, "cross_entropy", optimizer).fit(
        x, y, batch_size=16, epochs=2, shuffle=False, verbose=0, lr_scaling=None, devices=devices,
        accelerator="cpu", strategy=Pipeline(balance=[1, 3], microbatches=2))
    reference, plain = make()
    for _ in range(2):
        for start in range(0, len(x), 16):
            plain.zero_grad()
            torch.nn.functional.cross_entropy(reference(x[start:start + 16]), y[start:start + 16]).backward()
            plain.step()
    return max((net.state_dict()[k] - v).abs().max().item() for k, v in reference.state_dict().items())


def resume(devices: int, out: str) -> dict:
    pattern = os.path.join(out, "pipeline-epoch{epoch}.pt")
    model = fit(Pipeline(balance=[2, 2]), devices, batch_size=32, epochs=2,
                callbacks=[ModelCheckpoint(pattern, monitor="loss")])
    saved = os.path.join(out, "pipeline-saved.pt")
    if model.is_global_zero:   # after fit, a save on rank 0 alone must not wait for the other ranks
        model.save(saved)
    straight = fit(Pipeline(balance=[2, 2]), devices, batch_size=32, epochs=4).net.state_dict()
    resumed = fit(Pipeline(stages=1), devices, batch_size=16, epochs=4, resume_from=pattern.format(epoch=2))
    return {"saved": saved, "checkpoint": pattern.format(epoch=2), "weights": model.net.state_dict(),
            "straight": straight, "resumed": resumed.net.state_dict()}


def mesh(devices: int, out: str) -> dict:
    pattern = os.path.join(out, "mesh-epoch{epoch}.pt")
    two_by_two = fit(Pipeline(stages=2, microbatches=3), devices, batch_size=10, epochs=2,
                     callbacks=[ModelCheckpoint(pattern, monitor="loss")])
    resumed = fit(Pipeline(microbatches=4), devices, batch_size=20, epochs=2, resume_from=pattern.format(epoch=1))
    x, y = make_data()
    options = {"batch_size": 8, "devices": devices, "accelerator": "cpu", "strategy": Pipeline(stages=2)}
    return {"weights": two_by_two.net.state_dict(), "resumed": resumed.net.state_dict(),
            "scores": two_by_two.evaluate(x[:101], y[:101], verbose=0, return_dict=True, **options),
            "predictions": two_by_two.predict(x[:101], **options)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("checks")
    parser.add_argument("--devices", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(1)
    checks, results = args.checks.split(","), {}
    if "parity" in checks:
        results["parity"] = parity(args.devices)
    if "evaluate" in checks:
        results["evaluate"] = evaluate(args.devices)
    if "groups" in checks:
        results["groups"] = groups(args.devices)
    if "resume" in checks:
        results["resume"] = resume(args.devices, args.out)
    if "mesh" in checks:
        results["mesh"] = mesh(args.devices, args.out)
    torch.save(results, os.path.join(args.out, f"{launch_identity()[0]}.pt"))


if __name__ == "__main__":
    main()
