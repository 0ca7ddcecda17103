"""Continuing a run, as a real program: a fit stopped and resumed (from model.save, ModelCheckpoint or BackupAndRestore,
at an epoch end or mid-epoch) or called twice must end where one uninterrupted fit ends.

Usage: python resume_space.py OUT_DIR CHECK[,CHECK...]=STRATEGY[,STRATEGY...] ... [--devices 2] [--draws N] [--seed S]
each CHECK runs under each STRATEGY named with it:
  last_batch    ModelCheckpoint / BackupAndRestore after the last batch of an epoch, resumed (per strategy)
  windows       BackupAndRestore / ModelCheckpoint every 2 batches with gradient_accumulation_steps=2, 5 batches an
                epoch, stopped at global batch 7 and started again (per strategy)
  swa           SWA over a net with BatchNorm and Dropout: fit 2 epochs, model.save, resume to 4 (per strategy)
  callbacks     every stateful callback (EMA, EarlyStopping, ReduceLROnPlateau, ModelCheckpoint): fit 2 epochs,
                model.save, resume to 4; the weights and the callbacks' states after the fit (per strategy)
  csv           CSVLogger(append=True) after a stop past an epoch's end that followed the last checkpoint
  second_fit    fit(epochs=1) then fit(epochs=2, initial_epoch=1), SGD momentum and Adam over two param groups
                (per strategy)
  batchnorm     a fit of a net with BatchNorm: every rank's net after it (its buffers bit for bit), and its last
                validation, a predict and an evaluate on every rank against rank 0's net run as plain PyTorch
                (per strategy)
  drawn         N configurations drawn with seed S over the strategies, accumulation, clipping, schedulers,
                optimizers, BatchNorm or not (with it, batchnorm's checks of the straight run too), one fit or two,
                resuming from model.save or a mid-epoch ModelCheckpoint
Each check gives pairs (what one uninterrupted fit gave, what the continued run gave) under a name; global rank 0
(the caller with spawned ranks) writes them to OUT_DIR/result.pt. With --devices 1 each fit runs in this process.
The functions are imported by the one-process tests too.
"""
import argparse
import os
import random

import torch
from torch import nn

import easyfit
from easyfit.callbacks import (
    EMA,
    SWA,
    BackupAndRestore,
    Callback,
    CSVLogger,
    EarlyStopping,
    ModelCheckpoint,
    ReduceLROnPlateau,
)
from easyfit.distributed.environments import launch_identity

BATCH = 5


def make_data(devices: int, batches: int, short: int = 0, batch_size: int = BATCH):
    """`batches` batches an epoch on each of `devices` ranks; the last `short` samples missing."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(batches * batch_size * devices - short, 6, generator=generator)
    return x, (x[:, 0] + x[:, 1] > 0).long() + (x[:, 2] > 1).long()


def make_net(dropout: float = 0.0, batchnorm: bool = False) -> nn.Module:
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16) if batchnorm else nn.Identity(), nn.Tanh(),
                         nn.Dropout(dropout), nn.Linear(16, 3))


def make_model(optimizer: str = "sgd", scheduler: str | None = None, **net_options) -> easyfit.Model:
    """A Model whose optimizer keeps state: SGD with momentum or Adam, over two param groups (another LR each)."""
    net = make_net(**net_options)
    groups = [{"params": net[0].parameters()}, {"params": [*net[1].parameters(), *net[4].parameters()], "lr": 0.02}]
    built = torch.optim.SGD(groups, lr=0.05, momentum=0.9) if optimizer == "sgd" else torch.optim.Adam(groups, lr=0.01)
    options = {}
    if scheduler is not None:
        options = {"scheduler": lambda o: torch.optim.lr_scheduler.StepLR(o, 3, gamma=0.7),
                   "scheduler_interval": scheduler}
    return easyfit.Model(net, "cross_entropy", built, **options)


def fit(model: easyfit.Model, data, strategy: str, devices: int, **options) -> easyfit.Model:
    placement = {"devices": devices, "accelerator": "cpu", "strategy": strategy} if devices > 1 else {}
    model.fit(*data, batch_size=BATCH, seed=3, verbose=0, lr_scaling=None, **placement, **options)
    return model


def weights(model: easyfit.Model) -> dict:
    return {key: value.detach().clone() for key, value in model.net.state_dict().items()}


def outcome(model: easyfit.Model) -> dict:
    return {"weights": weights(model), "loss": list(model.history.history["loss"])}


class StopAt(Callback):
    """Stops the fit after its `at`-th training batch (counted across epochs, from 1), on every rank."""

    def __init__(self, at: int):
        self.at, self.count = at, 0

    def on_train_batch_end(self, batch, logs=None):
        self.count += 1
        if self.count == self.at:
            self.model.stop_training = True


def fresh(folder: str) -> str:
    os.makedirs(folder, exist_ok=True)
    return folder


def last_batch(strategy: str, devices: int, out: str) -> dict:
    """4 batches an epoch, a checkpoint every 4: each written after an epoch's last batch, inside the fit."""
    data, folder = make_data(devices, 4), fresh(os.path.join(out, f"last_batch-{strategy}"))
    pattern = os.path.join(folder, "ck-{epoch}-{batch}.pt")
    straight = fit(make_model(dropout=0.2), data, strategy, devices, epochs=3,
                   callbacks=[ModelCheckpoint(pattern, save_freq=4)])
    torch.manual_seed(99)
    resumed = fit(make_model(dropout=0.2), data, strategy, devices, epochs=3,
                  resume_from=pattern.format(epoch=1, batch=4))
    backup = os.path.join(folder, "backup")
    fit(make_model(dropout=0.2), data, strategy, devices, epochs=3,
        callbacks=[BackupAndRestore(backup, save_freq=4, delete_checkpoint=False), StopAt(6)])
    torch.manual_seed(99)
    restarted = fit(make_model(dropout=0.2), data, strategy, devices, epochs=3,
                    callbacks=[BackupAndRestore(backup, save_freq=4)])
    return {"ModelCheckpoint": (outcome(straight), outcome(resumed)),
            "BackupAndRestore": (outcome(straight), outcome(restarted))}


def windows(strategy: str, devices: int, out: str) -> dict:
    """5 batches an epoch (the last one short), gradient_accumulation_steps=2, save_freq=2: the counter runs across
    epochs, the windows start again at each epoch."""
    data, folder = make_data(devices, 5, short=devices), fresh(os.path.join(out, f"windows-{strategy}"))
    options = {"epochs": 3, "gradient_accumulation_steps": 2}
    straight = fit(make_model(dropout=0.2), data, strategy, devices, **options)
    backup, pattern = os.path.join(folder, "backup"), os.path.join(folder, "ck-{epoch}-{batch}.pt")
    fit(make_model(dropout=0.2), data, strategy, devices, **options,
        callbacks=[BackupAndRestore(backup, save_freq=2, delete_checkpoint=False),
                   ModelCheckpoint(pattern, save_freq=2), StopAt(7)])
    torch.manual_seed(99)
    restarted = fit(make_model(dropout=0.2), data, strategy, devices, **options,
                    callbacks=[BackupAndRestore(backup, save_freq=2)])
    batches = [int(name[:-3].split("-")[2]) for name in os.listdir(folder) if name.startswith("ck-")]
    return {"BackupAndRestore": (outcome(straight), outcome(restarted)),
            "checkpoints at window ends": ([True] * len(batches), [batch % 2 == 0 or batch == 5 for batch in batches])}


def swa(strategy: str, devices: int, out: str) -> dict:
    """SWA's BatchNorm pass at the end of a fit runs forwards in train mode (Dropout draws): the random state a
    model.save after the fit holds must be the one the fit left."""
    data, path = make_data(devices, 4), os.path.join(out, f"swa-{strategy}.pt")

    def averaging():
        return [SWA(swa_lr=0.02, start_epoch=1, annealing_epochs=2)]
    straight = fit(make_model(dropout=0.3, batchnorm=True), data, strategy, devices, epochs=4, callbacks=averaging())
    first = fit(make_model(dropout=0.3, batchnorm=True), data, strategy, devices, epochs=2, callbacks=averaging())
    first.save(path)
    torch.manual_seed(99)
    resumed = fit(make_model(dropout=0.3, batchnorm=True), data, strategy, devices, epochs=4, resume_from=path,
                  callbacks=averaging())
    return {"SWA": (outcome(straight), outcome(resumed))}


def batchnorm(strategy: str, devices: int, out: str) -> dict:
    """2 epochs of a net with BatchNorm, whose running statistics each rank updates from its own batches; the last
    validation pass ran the net the fit ends with."""
    data = make_data(devices, 4)
    model = fit(make_model(batchnorm=True), data, strategy, devices, epochs=2, validation_data=data)
    checks = served(model, data, devices)
    return {**checks, "validation": (checks["evaluate"][0], model.history.history["val_loss"][-1:])}


def served(model: easyfit.Model, data, devices: int) -> dict:
    """The net after a fit is rank 0's in every process (each rank's buffers and weights against rank 0's, bit for
    bit), so predict and evaluate on every rank give what rank 0's net gives as plain PyTorch on all the data."""
    if devices == 1:
        return {}
    mine = weights(model)
    ranks = [None] * devices
    torch.distributed.all_gather_object(ranks, mine)
    placement = {"devices": devices, "accelerator": "cpu", "strategy": "ddp"}
    predicted = model.predict(data[0], batch_size=BATCH, **placement)
    scores = model.evaluate(*data, batch_size=BATCH, verbose=0, return_dict=True, **placement)
    model.net.eval()
    with torch.no_grad():
        plain = model.net(data[0])
    return {**{f"rank {rank}'s net": ({"weights": ranks[0], "loss": []}, {"weights": each, "loss": []})
               for rank, each in enumerate(ranks[1:], 1)},
            "predict": (plain.flatten().tolist(), predicted.flatten().tolist()),
            "evaluate": ([nn.functional.cross_entropy(plain, data[1]).item()], [scores["loss"]])}


def stateful(folder: str) -> list:
    """Callbacks whose state steers the rest of the run: on a falling loss, mode "max" never improves after the first
    epoch, so ReduceLROnPlateau halves the LR each epoch and EarlyStopping counts towards its stop in the last one."""
    return [EMA(0.5), EarlyStopping(monitor="loss", mode="max", patience=3),
            ReduceLROnPlateau(monitor="loss", mode="max", factor=0.5, patience=0, min_lr=0.001),
            ModelCheckpoint(os.path.join(folder, "best.pt"), monitor="loss", save_best_only=True)]


def callbacks(strategy: str, devices: int, out: str) -> dict:
    """A model.save after a fit of 2 epochs holds every callback's state: the fit resumed from it to epoch 4 ends as
    4 epochs straight, its weights (EMA's averages) and the callbacks' states."""
    data, folder = make_data(devices, 4), fresh(os.path.join(out, f"callbacks-{strategy}"))
    path = os.path.join(folder, "saved.pt")
    straight = fit(make_model(), data, strategy, devices, epochs=4, callbacks=stateful(folder))
    fit(make_model(), data, strategy, devices, epochs=2, callbacks=stateful(folder)).save(path)
    resumed = fit(make_model(), data, strategy, devices, epochs=4, resume_from=path, callbacks=stateful(folder))
    return {"weights": (outcome(straight), outcome(resumed)),
            "states": (callback_numbers(straight), callback_numbers(resumed))}


def callback_numbers(model: easyfit.Model) -> list[float]:
    """Every number of the callbacks' states a model.save holds, in the order of their keys."""
    numbers = []

    def walk(value):
        if isinstance(value, dict):
            for key in sorted(value, key=str):
                walk(value[key])
        elif isinstance(value, torch.Tensor):
            numbers.extend(value.double().flatten().tolist())
        elif isinstance(value, (int, float)):
            numbers.append(float(value))
    walk(model.checkpoint_state()["callbacks"])
    return numbers


def csv(strategy: str, devices: int, out: str) -> dict:
    """8 batches an epoch, a checkpoint every 5 (the last before the stop after epoch 3's batch 4), the stop after
    epoch 3's last batch: its row was written after the checkpoint the resume starts from."""
    data, folder = make_data(devices, 8), fresh(os.path.join(out, f"csv-{strategy}"))
    straight_log, log, last = (os.path.join(folder, name) for name in ("straight.csv", "log.csv", "last.pt"))
    fit(make_model(dropout=0.2), data, strategy, devices, epochs=5, callbacks=[CSVLogger(straight_log)])
    fit(make_model(dropout=0.2), data, strategy, devices, epochs=5,
        callbacks=[CSVLogger(log, append=True), ModelCheckpoint(last, save_freq=5), StopAt(24)])
    fit(make_model(dropout=0.2), data, strategy, devices, epochs=5, resume_from=last,
        callbacks=[CSVLogger(log, append=True)])
    return {"CSVLogger": (read_rows(straight_log), read_rows(log))}


def read_rows(path: str) -> list[dict]:
    import csv as csv_module
    with open(path, newline="") as file:
        return [{key: float(value) for key, value in row.items()} for row in csv_module.DictReader(file)]


def second_fit(strategy: str, devices: int, out: str) -> dict:
    """Calling fit again continues the first fit: the optimizer state (momentum, Adam's moments) handed back to the
    user's optimizer after the first and taken up by the second."""
    data, pairs = make_data(devices, 4), {}
    for optimizer in ("sgd", "adam"):
        straight = fit(make_model(optimizer), data, strategy, devices, epochs=2)
        twice = fit(make_model(optimizer), data, strategy, devices, epochs=1)
        fit(twice, data, strategy, devices, epochs=2, initial_epoch=1)
        expected = outcome(straight)
        expected["loss"] = expected["loss"][1:]   # the second fit's History holds its own epoch
        pairs[optimizer] = (expected, outcome(twice))
    return pairs


def draw(rng: random.Random, strategies: list[str]) -> dict:
    """One configuration of the space users live in."""
    return {"strategy": rng.choice(strategies), "optimizer": rng.choice(["sgd", "adam"]),
            "scheduler": rng.choice([None, "step", "epoch"]), "accumulate": rng.choice([1, 2, 3]),
            "clip": rng.choice([None, 0.5]), "dropout": rng.choice([0.0, 0.2]), "batches": rng.choice([4, 5, 7]),
            "save_freq": rng.choice([1, 2, 3, 6]), "epochs": rng.choice([2, 3]), "two_fits": rng.random() < 0.3,
            "source": rng.choice(["ModelCheckpoint", "model.save"]), "pick": rng.random(),
            "batchnorm": rng.random() < 0.5}


def drawn(config: dict, devices: int, out: str, index: int) -> dict:
    """The straight run (one fit, or two: the first to epoch 1) writes a ModelCheckpoint every `save_freq` batches;
    the resumed run starts from one of them (`pick`), or from a model.save after a fit of 1 epoch."""
    folder = fresh(os.path.join(out, f"drawn-{index}"))
    strategy, data = config["strategy"], make_data(devices, config["batches"], short=devices)
    options = {"gradient_accumulation_steps": config["accumulate"], "gradient_clip_val": config["clip"]}

    def model():
        return make_model(config["optimizer"], config["scheduler"], dropout=config["dropout"],
                          batchnorm=config["batchnorm"])
    pattern = os.path.join(folder, "ck-{epoch}-{batch}.pt")
    checkpoints = [ModelCheckpoint(pattern, save_freq=config["save_freq"])]
    straight = model()
    if config["two_fits"]:
        fit(straight, data, strategy, devices, epochs=1, callbacks=checkpoints, **options)
        fit(straight, data, strategy, devices, epochs=config["epochs"], initial_epoch=1, callbacks=checkpoints,
            **options)
    else:
        fit(straight, data, strategy, devices, epochs=config["epochs"], callbacks=checkpoints, **options)
    if config["source"] == "model.save":
        source = os.path.join(folder, "saved.pt")
        fit(model(), data, strategy, devices, epochs=1, **options).save(source)
    else:
        written = sorted(name for name in os.listdir(folder) if name.startswith("ck-"))
        source = os.path.join(folder, written[int(config["pick"] * len(written))])
    torch.manual_seed(99)
    resumed = fit(model(), data, strategy, devices, epochs=config["epochs"], resume_from=source, **options)
    pair = outcome(straight), outcome(resumed)
    for each in pair:   # the last epoch's loss (a second fit's History starts at its own first epoch)
        each["loss"] = each["loss"][-1:]
    checks = served(straight, data, devices) if config["batchnorm"] else {}
    return {f"drawn {index} {config} from {os.path.basename(source)}": pair,
            **{f"served {index} {strategy} {name}": pair for name, pair in checks.items()}}


def differences(results: dict) -> list[str]:
    """What differs in each pair: the weights (bit for bit), the History's loss and a CSV's values (up to rounding)."""
    found = []
    for name, (expected, actual) in results.items():
        if isinstance(expected, dict):
            changed = [key for key, value in expected["weights"].items() if not torch.equal(actual["weights"][key],
                                                                                              value)]
            expected, actual = expected["loss"], actual["loss"]
            if changed:
                found.append(f"{name}: the weights differ in {changed}")
        if isinstance(expected, list) and expected and isinstance(expected[0], dict):
            expected, actual = [list(row.values()) for row in expected], [list(row.values()) for row in actual]
        same = len(expected) == len(actual) and all(
            torch.allclose(torch.tensor(a, dtype=torch.float64), torch.tensor(b, dtype=torch.float64), atol=1e-6,
                           rtol=0) for a, b in zip(expected, actual))
        if not same:
            found.append(f"{name}: {expected} != {actual}")
    return found


CHECKS = {"last_batch": last_batch, "windows": windows, "swa": swa, "callbacks": callbacks, "csv": csv,
          "second_fit": second_fit, "batchnorm": batchnorm}


def run(plan: dict, devices: int, out: str, draws: int = 0, seed: int = 0) -> dict:
    """{check: its strategies} -> {name: (straight, continued)}; "drawn" draws `draws` configurations over its own."""
    torch.set_num_threads(1)
    results = {}
    for check, strategies in plan.items():
        if check == "drawn":
            rng = random.Random(seed)
            for index in range(draws):
                results.update(drawn(draw(rng, strategies), devices, out, index))
            continue
        for strategy in strategies:
            for name, pair in CHECKS[check](strategy, devices, out).items():
                results[f"{check} {strategy} {name}"] = pair
    return results


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("plan", nargs="+", help="CHECK[,CHECK...]=STRATEGY[,STRATEGY...]")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--draws", type=int, default=0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    plan = {}
    for item in args.plan:
        checks, strategies = item.split("=")
        for check in checks.split(","):
            plan.setdefault(check, []).extend(strategies.split(","))
    results = run(plan, args.devices, args.out, args.draws, args.seed)
    if launch_identity()[0] == 0:
        torch.save(results, os.path.join(args.out, "result.pt"))


if __name__ == "__main__":
    main()
