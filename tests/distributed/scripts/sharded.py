"""Sharded strategies as a real program: several strategies per launch, several checks per strategy.

Usage: python sharded.py OUT_DIR CHECKS STRATEGY [STRATEGY ...] [--devices 2] [--cases plain,accumulate_clip]
                        [--sharded NAME,NAME] [--mixed NAME,NAME]
CHECKS is a comma-separated list of:
  parity      Adam on the combined batch, plain and with accumulation 2 + clipping (weights after fit)
  checkpoint  a rank-0-only save after fit, a 4 + 4 epoch resume (ModelCheckpoint) and the 8 epochs straight
  memory      per-rank bytes of parameters and optimizer state on a net of a few million parameters, after a step
  bf16        precision="bf16-mixed", 10 epochs: the loss of each epoch and the weights after fit
  overflow    precision="16-mixed", one step whose gradient overflows in rank 1's shard only: how far each
              row of the weight moved (every rank must skip the step, as DDP does)
  resume_one  (with --devices 1) resume fsdp's 2-process sharded directory OUT_DIR/fsdp-sharded-epoch4 on one
              process with the same global batch (32), to epoch 8
  schedule    a per-step SequentialLR under linear LR scaling, with accumulation 2 and clipping: each step's LR,
              the optimizer's own, the History and the weights (lr_space.py's SHARDED_SCHEDULE)
  averaging   EMA(0.9) with validation and SWA(swa_lr=0.02, start_epoch=1, annealing_epochs=1), SGD, 3 epochs
              each: the net after each fit and EMA's validation losses
--sharded names the strategies whose sharded checkpoint format (state_dict_type="sharded") is checked: 4 epochs
writing directories with ModelCheckpoint, a resume to 8, 8 straight, and the weights and optimizer state after epoch 4.
--mixed names strategies that also run the bf16 and overflow checks.
Each rank writes OUT_DIR/<rank>.pt with what it measured; rank 0 adds the weights and the trained predictions.
"""
import argparse
import functools
import os
import re
import sys

import torch

import easyfit
from easyfit.callbacks import EMA, SWA, ModelCheckpoint
from easyfit.distributed.environments import launch_identity
from easyfit.distributed.strategy_parts.sharding import rank_memory
from easyfit.parts.precision import cpu_supports_fp16

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import lr_space
from common import make_data, make_net

PARITY_CASES = {"plain": {"epochs": 6},
                "accumulate_clip": {"epochs": 10, "gradient_accumulation_steps": 2, "gradient_clip_val": 0.5}}
LR = 0.01


def fit(strategy, devices: int, net=None, batch_size: int = 16, optimizer=None, **options) -> easyfit.Model:
    """A fit of the shared data on `strategy`; Adam unless `optimizer` (a factory of the parameters) is given."""
    x, y = make_data()
    net = net or make_net()
    optimizer = (optimizer or functools.partial(torch.optim.Adam, lr=LR))(net.parameters())
    model = easyfit.Model(net, "cross_entropy", optimizer)
    options = {"epochs": 2, **options}
    model.fit(x, y, batch_size=batch_size, shuffle=False, verbose=0, lr_scaling=None, devices=devices,
              accelerator="cpu", strategy=strategy, **options)
    return model


def parity(strategy: str, devices: int, cases: list[str]) -> dict:
    return {case: {k: v.clone() for k, v in fit(strategy, devices, **PARITY_CASES[case]).net.state_dict().items()}
            for case in cases}


@functools.cache
def straight(strategy: str, devices: int) -> dict:
    """The weights after 8 epochs in one fit."""
    return fit(strategy, devices, epochs=8).net.state_dict()


def checkpoint(strategy: str, devices: int, out: str) -> dict:
    x, _ = make_data()
    model = fit(strategy, devices, epochs=2)
    saved = os.path.join(out, f"{strategy}-saved.pt")
    if model.is_global_zero:   # after fit, a save on rank 0 alone must not wait for the other ranks
        model.save(saved)
    pattern = os.path.join(out, f"{strategy}-epoch{{epoch}}.pt")
    fit(strategy, devices, epochs=4, callbacks=[ModelCheckpoint(pattern, monitor="loss")])
    resumed = fit(strategy, devices, epochs=8, resume_from=pattern.format(epoch=4)).net.state_dict()
    return {"saved": saved, "predictions": model.predict(x, devices=1, strategy="single"),
            "straight": straight(strategy, devices), "resumed": resumed}


def averaging(strategy: str, devices: int) -> dict:
    x, y = make_data()
    found = {}
    for name, callback in (("ema", EMA(0.9)), ("swa", SWA(swa_lr=0.02, start_epoch=1, annealing_epochs=1))):
        model = fit(strategy, devices, optimizer=functools.partial(torch.optim.SGD, lr=0.1), epochs=3,
                    validation_data=(x[:64], y[:64]), callbacks=[callback])
        found[name] = {"averaged": {key: value.detach().clone() for key, value in model.net.state_dict().items()},
                       "val_loss": model.history.history["val_loss"]}
    return found


def bf16(strategy: str, devices: int) -> dict:
    model = fit(strategy, devices, epochs=10, precision="bf16-mixed")
    return {"loss": model.history.history["loss"], "weights": model.net.state_dict()}


def overflow(strategy: str, devices: int) -> dict:
    torch.manual_seed(0)
    net = torch.nn.Linear(4, 2, bias=False)   # sharded by rows: output 1's row lies in rank 1's shard
    before = net.weight.detach().clone()
    x, y = torch.ones(8, 4), torch.tensor([[0.0, 3e4]]).repeat(8, 1)   # output 1's scaled gradient overflows fp16
    model = easyfit.Model(net, "mse", "sgd", lr=1.0)   # a step would move rank 0's row by about 0.1
    if strategy.startswith("deepspeed") and not cpu_supports_fp16():   # refused on every rank before any work
        try:
            model.fit(x, y, devices=devices, accelerator="cpu", strategy=strategy, precision="16-mixed")
        except ValueError as error:
            return {"refused": str(error)}
        return {"refused": None}
    model.fit(x, y, epochs=1, batch_size=4, verbose=0, lr_scaling=None, devices=devices, accelerator="cpu",
              strategy=strategy, precision="16-mixed")
    return {"row_change": (net.weight.detach() - before).abs().amax(dim=1).tolist()}


def sharded_format(strategy: str):
    """The strategy of that name, writing sharded checkpoint directories."""
    if strategy == "fsdp":
        return easyfit.strategies.FSDP(state_dict_type="sharded")
    stage = re.fullmatch(r"deepspeed_stage_(\d)", strategy)
    return easyfit.strategies.DeepSpeed(stage=int(stage.group(1)), state_dict_type="sharded")


def sharded(strategy: str, devices: int, out: str) -> dict:
    pattern = os.path.join(out, f"{strategy}-sharded-epoch{{epoch}}")
    model = fit(sharded_format(strategy), devices, epochs=4, callbacks=[ModelCheckpoint(pattern, monitor="loss")])
    at_epoch4 = {"net": model.net.state_dict(), "optimizer": model.optimizer.state_dict()}
    resumed = fit(sharded_format(strategy), devices, epochs=8, resume_from=pattern.format(epoch=4))
    return {"directory": pattern.format(epoch=4), "epoch4": at_epoch4, "straight": straight(strategy, devices),
            "resumed": resumed.net.state_dict()}


def resume_one(out: str) -> dict:
    resumed = fit(easyfit.strategies.FSDP(state_dict_type="sharded"), 1, batch_size=32, epochs=8,
                  resume_from=os.path.join(out, "fsdp-sharded-epoch4"))
    return {"resumed": resumed.net.state_dict(), "epochs": len(resumed.history.history["loss"])}


class Measure(easyfit.callbacks.Callback):
    """Bytes this rank holds after the first optimizer step of the fit."""

    def on_train_batch_end(self, batch, logs=None):
        if batch == 0:
            self.bytes = rank_memory(self.model._training.net, self.model.optimizer)


def memory(strategy: str, devices: int) -> dict:
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(6, 1024), torch.nn.Tanh(), torch.nn.Linear(1024, 1024), torch.nn.Tanh(),
                              torch.nn.Linear(1024, 1024), torch.nn.Tanh(), torch.nn.Linear(1024, 3))
    measure = Measure()
    fit(strategy, devices, net=net, epochs=1, callbacks=[measure])
    return measure.bytes


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("checks")
    parser.add_argument("strategies", nargs="+")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--sharded", default="", help="the strategies whose sharded checkpoint format to check")
    parser.add_argument("--cases", default=",".join(PARITY_CASES), help="the parity cases to run")
    parser.add_argument("--mixed", default="", help="strategies that also run the bf16 and overflow checks")
    args = parser.parse_args()
    torch.set_num_threads(1)
    checks, results = args.checks.split(","), {}
    for strategy in args.strategies:
        found = results[strategy] = {}
        mixed = strategy in args.mixed.split(",")
        if "bf16" in checks or mixed:
            found["bf16"] = bf16(strategy, args.devices)
        if "overflow" in checks or mixed:
            found["overflow"] = overflow(strategy, args.devices)
        if strategy == "ddp":   # the baseline of the memory check
            if "memory" in checks:
                found["memory"] = memory(strategy, args.devices)
            continue
        if "parity" in checks:
            found["parity"] = parity(strategy, args.devices, args.cases.split(","))
        if "checkpoint" in checks:
            found["checkpoint"] = checkpoint(strategy, args.devices, args.out)
        if "memory" in checks:
            found["memory"] = memory(strategy, args.devices)
        if strategy in args.sharded.split(","):
            found["sharded"] = sharded(strategy, args.devices, args.out)
        if "schedule" in checks:
            run = {"devices": args.devices, "accelerator": "cpu", "strategy": strategy}
            found["schedule"] = lr_space.fit(lr_space.SHARDED_SCHEDULE, run)
        if "averaging" in checks:
            found["averaging"] = averaging(strategy, args.devices)
        if "resume_one" in checks:
            found["resume_one"] = resume_one(args.out)
    results["mlflow_imported"] = "mlflow" in sys.modules   # DeepSpeed's autotuner would import it with deepspeed
    torch.save(results, os.path.join(args.out, f"{launch_identity()[0]}.pt"))


if __name__ == "__main__":
    main()
