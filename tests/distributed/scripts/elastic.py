"""A fit that fails on chosen attempts, run under torchrun or easyfit's own `max_restarts` by the fault-tolerance
tests; every restarted attempt continues from the fault-tolerance checkpoint with no code here to do it.

Usage: python elastic.py OUT_DIR [--strategy ddp|ddp_spawn|fsdp|fsdp-sharded|tp] [--max-restarts N]
                                 [--launch-restarts N] [--every N] [--record] [--save-every N] [--resume PATH]
                                 [--fail ATTEMPT:MODE:RANK:EPOCH:BATCH ...]
MODE: kill (SIGKILL), raise (an exception in a callback), or lose-node (SIGKILL the torchrun agent, then itself).
The fit is a user's: a metric, validation data and an LR scheduler. --save-every adds a ModelCheckpoint every N
batches (ck-<epoch>-<batch>.pt where the script starts); --resume continues from such a file (fit(resume_from=...)).
Rank 0 writes OUT_DIR/result.pt (weights, History, the counting callback's count, the world size and LR);
with --record every rank writes the samples it trains to OUT_DIR/seen-<world size>-<attempt>-<rank>.txt.
"""
import argparse
import os
import signal
import sys

import torch
from torch import nn

import easyfit
from easyfit.callbacks import Callback, ModelCheckpoint

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import make_data, make_net

EPOCHS, BATCH_SIZE, LR = 4, 16, 0.05


def attempt() -> int:
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT") or os.environ.get("EASYFIT_RESTART_COUNT") or 0)


class Fail(Callback):
    """On the chosen attempt, rank, epoch and batch: die, raise, or take the whole node (the agent) down."""

    def __init__(self, specs: list[str]):
        self.specs = [spec.split(":") for spec in specs]
        self.epoch = 0

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        for when, mode, rank, epoch, at in self.specs:
            if (int(when), int(rank), int(epoch), int(at)) != (attempt(), self.model.global_rank, self.epoch, batch):
                continue
            if mode == "lose-node":
                os.kill(os.getppid(), signal.SIGKILL)
            if mode in ("kill", "lose-node"):
                os.kill(os.getpid(), signal.SIGKILL)
            raise RuntimeError(f"deliberate failure on rank {rank} in epoch {int(epoch) + 1}, batch {at}")


class CountBatches(Callback):
    """A callback with a state: a restarted fit continues its count."""

    may_stop_training = False

    def __init__(self):
        self.count = 0

    def on_train_batch_end(self, batch, logs=None):
        self.count += 1

    def state_dict(self):
        return {"count": self.count}

    def load_state_dict(self, state):
        self.count = state["count"]


class Recorder(nn.Module):
    """Drops the last input column (the sample's index) and, while training, appends the indices to a file."""

    def __init__(self, path: str):
        super().__init__()
        self.path, self.epoch, self.batch = path, 0, 0

    def forward(self, x):
        if self.training:
            with open(self.path, "a") as file:
                file.write(f"{self.epoch} {self.batch} {' '.join(str(int(i)) for i in x[:, -1])}\n")
        return x[:, :-1]


class Position(Callback):
    may_stop_training = False

    def __init__(self, recorder: Recorder):
        self.recorder = recorder

    def on_epoch_begin(self, epoch, logs=None):
        self.recorder.epoch = epoch

    def on_train_batch_begin(self, batch, logs=None):
        self.recorder.batch = batch


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--strategy", default="ddp")
    parser.add_argument("--max-restarts", type=int, default=None)
    parser.add_argument("--every", type=int, default=None, help="fault_tolerance_every_n_steps")
    parser.add_argument("--record", action="store_true")
    parser.add_argument("--fail", nargs="*", default=[])
    parser.add_argument("--save-every", type=int, default=None, help="ModelCheckpoint(save_freq=N)")
    parser.add_argument("--resume", default=None, help="fit(resume_from=...)")
    parser.add_argument("--launch-restarts", type=int, default=None, help="easyfit.launch(max_restarts=...) first")
    args = parser.parse_args()
    if args.launch_restarts is not None:
        easyfit.launch(devices=2, accelerator="cpu", max_restarts=args.launch_restarts)
    torch.set_num_threads(1)
    x, y = make_data()
    net = make_net()
    callbacks = [Fail(args.fail), CountBatches()]
    if args.record:
        rank = os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0"))
        world = os.environ.get("WORLD_SIZE", "2")
        recorder = Recorder(os.path.join(args.out, f"seen-{world}-{attempt()}-{rank}.txt"))
        net = nn.Sequential(recorder, net)
        x = torch.cat([x, torch.arange(len(x), dtype=x.dtype)[:, None]], dim=1)
        callbacks.append(Position(recorder))
    if args.save_every:
        callbacks.append(ModelCheckpoint("ck-{epoch}-{batch}.pt", save_freq=args.save_every))
    optimizer = torch.optim.SGD(net.parameters(), lr=LR)
    # a user's fit: a metric, validation data and a scheduler (the LR halves after the second epoch)
    model = easyfit.Model(net, "cross_entropy", optimizer, metrics=["accuracy"],
                          scheduler=torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5))
    strategy = easyfit.strategies.FSDP(state_dict_type="sharded") if args.strategy == "fsdp-sharded" else args.strategy
    devices = "auto" if "TORCHELASTIC_RUN_ID" in os.environ else 2
    # tensor parallelism's 2 ranks share one batch: the combined batch of the data-parallel strategies' two
    batch_size = 2 * BATCH_SIZE if args.strategy == "tp" else BATCH_SIZE
    history = model.fit(x, y, epochs=EPOCHS, batch_size=batch_size, shuffle=args.record, verbose=0,
                        validation_data=(x[:40], y[:40]),
                        callbacks=callbacks, strategy=strategy, devices=devices, accelerator="cpu",
                        max_restarts=args.max_restarts, fault_tolerance_every_n_steps=args.every,
                        resume_from=args.resume)
    if model.is_global_zero:
        torch.save({"state": net.state_dict(), "history": history.history, "count": callbacks[1].count,
                    "world_size": history.params["world_size"], "summary": history.params["summary"],
                    "lr": [group["lr"] for group in model.optimizer.param_groups]},
                   os.path.join(args.out, "result.pt"))


if __name__ == "__main__":
    main()
