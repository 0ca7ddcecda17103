"""LR schedules under LR scaling: the fits the lr_schedules script runs on 2 ranks, and what plain PyTorch does on the
combined batch with the same schedule, each step at the schedule's rate times the scale (tests/distributed/
test_lr_schedules.py). Module-level functions only: a spawned rank unpickles the schedulers and callbacks."""
import os
import random

import torch

import easyfit
from easyfit.callbacks import Callback, LearningRateScheduler, ModelCheckpoint, ReduceLROnPlateau

SAMPLES, BATCH, EPOCHS, LR = 64, 8, 4, 0.1
F = torch.optim.lr_scheduler


def data() -> tuple:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(SAMPLES, 5, generator=generator)
    y = (x[:, 0] + x[:, 1] > 0).long() + (x[:, 2] > 1).long()
    return x, y, torch.rand(SAMPLES, generator=generator) + 0.5


def new_net() -> torch.nn.Module:
    torch.manual_seed(3)
    return torch.nn.Linear(5, 3)


def decay(step: int) -> float:
    return 1.0 / (1.0 + step)


class Halving:
    """A user's own scheduler: no torch base class, absolute rates of its own (0.1 × 0.7^steps)."""

    def __init__(self, optimizer):
        self.optimizer, self.steps = optimizer, 0

    def step(self):
        self.steps += 1
        for group in self.optimizer.param_groups:
            group["lr"] = LR * 0.7 ** self.steps

    def state_dict(self):
        return {"steps": self.steps}

    def load_state_dict(self, state):
        self.steps = state["steps"]


def halving(opt):
    return Halving(opt)


def one_cycle(opt):
    return F.OneCycleLR(opt, max_lr=LR, total_steps=SAMPLES // (2 * BATCH) * EPOCHS)


def cyclic(opt):
    return F.CyclicLR(opt, 0.01, LR, step_size_up=3, cycle_momentum=False)


def sequential(opt):
    return F.SequentialLR(opt, [F.LinearLR(opt, start_factor=0.25, total_iters=2), F.ExponentialLR(opt, 0.5)],
                          milestones=[2])


def chained(opt):
    return F.ChainedScheduler([F.CyclicLR(opt, 0.01, LR, step_size_up=3, cycle_momentum=False),
                               F.ExponentialLR(opt, 0.9)])


def plateau(opt):   # the loss falls every epoch: with mode "max" each epoch after the first halves the LR, to min_lr
    return F.ReduceLROnPlateau(opt, mode="max", factor=0.5, patience=0, min_lr=0.03)


def lambda_lr(opt):
    return F.LambdaLR(opt, decay)


def step_lr(opt):
    return F.StepLR(opt, step_size=1, gamma=0.5)


def by_epoch(epoch: int) -> float:
    return LR / (epoch + 1)


#: name -> (scheduler factory, interval); "callback": the rate set by easyfit's LearningRateScheduler callback,
#: "plateau callback": by its ReduceLROnPlateau callback (which reduces as `plateau` does)
SCHEDULES = {"OneCycleLR": (one_cycle, "step"), "CyclicLR": (cyclic, "step"), "SequentialLR": (sequential, "step"),
             "ChainedScheduler": (chained, "step"), "ReduceLROnPlateau": (plateau, "epoch"),
             "LambdaLR": (lambda_lr, "step"), "StepLR": (step_lr, "epoch"), "user": (halving, "step"),
             "callback": (None, "epoch"), "plateau callback": (None, "epoch")}


def schedule_callbacks(name: str | None) -> list:
    if name == "callback":
        return [LearningRateScheduler(by_epoch)]
    if name == "plateau callback":
        return [ReduceLROnPlateau(monitor="loss", factor=0.5, patience=0, mode="max", min_lr=0.03)]
    return []


#: the compiled fit's configuration
COMPILED = {"schedule": "OneCycleLR", "accumulate": 2, "clip": 0.05, "weighted": True}
#: the fit the sharded strategies' launches run (tests/distributed/scripts/sharded.py)
SHARDED_SCHEDULE = {"schedule": "SequentialLR", "accumulate": 2, "clip": 0.05, "weighted": False}


def draw(count: int, seed: int) -> list[dict]:
    """Configurations of the differential: schedule, accumulation, clipping, sample weights, steps_per_epoch (3 of
the 4 batches: an epoch of 3, then one of the pass's last batch, whose accumulation window is short)."""
    rng = random.Random(seed)
    names = [None, *SCHEDULES]
    return [{"schedule": rng.choice(names), "accumulate": rng.choice([1, 2, 3]), "clip": rng.choice([None, 0.05]),
             "weighted": rng.random() < 0.5, "steps": rng.choice([None, 3])} for _ in range(count)]


class StepRates(Callback):
    """Records the LR each optimizer step takes (a step pre-hook on the optimizer that trains) and the one the
    optimizer holds when each batch begins."""

    def __init__(self):
        self.steps, self.held, self.hook = [], [], None

    def on_train_begin(self, logs=None):
        self.hook = self.model.optimizer.register_step_pre_hook(
            lambda opt, args, kwargs: self.steps.append(float(opt.param_groups[0]["lr"])))

    def on_train_batch_begin(self, batch, logs=None):
        self.held.append(float(self.model.optimizer.param_groups[0]["lr"]))

    def on_train_end(self, logs=None):
        self.hook.remove()
        self.hook = None


def fit(config: dict, run: dict, callbacks: tuple = (), resume_from=None) -> dict:
    """One fit of `config` with linear LR scaling under `run` (strategy, devices); what it recorded."""
    x, y, w = data()
    net = new_net()
    factory, interval = SCHEDULES[config["schedule"]] if config["schedule"] else (None, "epoch")
    optimizer = torch.optim.SGD(net.parameters(), lr=LR)
    model = easyfit.Model(net, "cross_entropy", optimizer, scheduler=factory, scheduler_interval=interval)
    rates = StepRates()
    callbacks = [rates, *callbacks, *schedule_callbacks(config["schedule"])]
    history = model.fit(x, y, epochs=EPOCHS, batch_size=BATCH, shuffle=False, verbose=0, callbacks=callbacks,
                        sample_weight=w if config["weighted"] else None, lr_scaling="linear",
                        gradient_accumulation_steps=config["accumulate"], gradient_clip_val=config["clip"],
                        compile={"backend": "aot_eager"} if config.get("compile") else None,
                        steps_per_epoch=config.get("steps"), resume_from=resume_from, **run)
    return {"steps": rates.steps, "held": rates.held, "after": optimizer.param_groups[0]["lr"],
            "loss": history.history["loss"], "weights": {k: v.clone() for k, v in net.state_dict().items()}}


def resumed(config: dict, run: dict, folder: str) -> dict:
    """A fit that writes a checkpoint after its 6th batch (mid-epoch), then a new fit resumed from it: the
    checkpoint's rates and both fits' weights."""
    path = os.path.join(folder, "mid-{epoch}-{batch}.pt")
    straight = fit(config, run, callbacks=(ModelCheckpoint(path, save_freq=6),))
    written = path.format(epoch=2, batch=2)
    lrs = [group["lr"] for group in torch.load(written, weights_only=True)["optimizer"]["param_groups"]]
    return {"straight": straight["weights"], "resumed": fit(config, run, resume_from=written)["weights"], "lrs": lrs}


def plain(config: dict, factor: float = 2.0, ranks: int = 2) -> dict:
    """Plain PyTorch in one process on the combined batch of `ranks` ranks, each step at the schedule's rate times
    `factor`; the same record as `fit`."""
    x, y, w = data()
    net = new_net()
    optimizer = torch.optim.SGD(net.parameters(), lr=LR)
    factory, interval = SCHEDULES[config["schedule"]] if config["schedule"] else (None, "epoch")
    factory = plateau if config["schedule"] == "plateau callback" else factory
    scheduler = factory(optimizer) if factory is not None else None
    combined, accumulate = BATCH * ranks, config["accumulate"]
    record = {"steps": [], "held": [], "loss": []}
    epochs = epoch_starts(list(range(0, SAMPLES, combined)), config.get("steps"))
    for epoch in range(EPOCHS):
        if config["schedule"] == "callback":
            optimizer.param_groups[0]["lr"] = by_epoch(epoch)
        losses = []
        starts = epochs[epoch]
        for index, start in enumerate(starts):
            record["held"].append(optimizer.param_groups[0]["lr"])
            if index % accumulate == 0:
                optimizer.zero_grad()
            batch = slice(start, start + combined)
            per_sample = torch.nn.functional.cross_entropy(net(x[batch]), y[batch], reduction="none")
            loss = (per_sample * w[batch]).mean() if config["weighted"] else per_sample.mean()
            (loss / accumulate).backward()
            losses.append(loss.item())
            if (index + 1) % accumulate and index + 1 < len(starts):
                continue
            if config["clip"] is not None:
                torch.nn.utils.clip_grad_norm_(net.parameters(), config["clip"])
            own = optimizer.param_groups[0]["lr"]
            optimizer.param_groups[0]["lr"] = own * factor
            record["steps"].append(own * factor)
            optimizer.step()
            optimizer.param_groups[0]["lr"] = own
            if scheduler is not None and interval == "step":
                scheduler.step()
        record["loss"].append(sum(losses) / len(losses))
        if isinstance(scheduler, F.ReduceLROnPlateau):
            scheduler.step(record["loss"][-1])
        elif scheduler is not None and interval == "epoch":
            scheduler.step()
    record["after"], record["weights"] = optimizer.param_groups[0]["lr"], net.state_dict()
    return record


def epoch_starts(starts: list[int], steps: int | None) -> list[list[int]]:
    """The batches (`starts`: one pass) each epoch trains: the whole pass, or with steps_per_epoch `steps` batches,
    a pass carried on into the next epoch, which ends early where the pass runs out."""
    epochs, taken = [], 0
    for _ in range(EPOCHS):
        epochs.append(starts[taken:taken + (steps or len(starts))])
        taken = (taken + len(epochs[-1])) % len(starts)
    return epochs


def differences(record: dict, expected: dict) -> list[str]:
    """What a fit's record has other than `expected` (`plain`'s): each step's rate, the optimizer's own rate at each
    batch start and after the fit (relative 1e-6), History's loss and the weights (1e-5)."""
    found = []
    for key, tolerance in (("steps", 1e-6), ("held", 1e-6), ("loss", 1e-5)):
        if len(record[key]) != len(expected[key]) or any(
                abs(a - b) > tolerance * max(abs(b), 1.0 if key == "loss" else 0.0)
                for a, b in zip(record[key], expected[key])):
            found.append(f"{key}: {record[key]} instead of {expected[key]}")
    if abs(record["after"] - expected["after"]) > 1e-6 * abs(expected["after"]):
        found.append(f"after the fit: {record['after']} instead of {expected['after']}")
    for name, value in expected["weights"].items():
        difference = (record["weights"][name] - value).abs().max().item()
        if difference > 1e-5:
            found.append(f"weight {name}: {difference:.2e} from plain PyTorch")
    return found
