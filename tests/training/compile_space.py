"""The space of fits a user runs, drawn at random for the differential test of compile= against eager
(tests/training/test_compile_differential.py and its soak, scripts/compile_soak.sh).

A configuration is a net (layers users train), an optimizer (those traced into the whole-step program and those
stepped apart), a precision, accumulation, clipping, class or sample weights, a schedule, a callback that changes
the run between epochs, steps_per_execution, a batch size (most leave a short last batch), how the data comes
(tensors in memory, a DataLoader, or a DataLoader whose batches change length, for the sequence nets) and
validation. Every net takes 12 float features (a sequence net reads them as steps of 4, so 8 features are a shorter
sequence) and predicts 3 classes, so one data set serves them all.
"""
from __future__ import annotations

import dataclasses
import itertools
import random

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import easyfit
from easyfit.callbacks import Callback, LearningRateScheduler, ReduceLROnPlateau


class Reshaped(nn.Module):
    def __init__(self, *shape):
        super().__init__()
        self.shape = shape

    def forward(self, x):
        return x.reshape(x.shape[0], *self.shape)


class LastStep(nn.Module):
    """A recurrent layer's last output."""

    def __init__(self, rnn: nn.Module):
        super().__init__()
        self.rnn = rnn

    def forward(self, x):
        return self.rnn(x)[0][:, -1]


class MeanOverTime(nn.Module):
    def forward(self, x):
        return x.mean(1)


class Bagged(nn.Module):
    """An Embedding with a padding index over token ids read from the features, beside a Linear of them."""

    def __init__(self):
        super().__init__()
        self.embedding = nn.Embedding(8, 6, padding_idx=0)
        self.dense = nn.Linear(12, 6)
        self.head = nn.Linear(6, 3)

    def forward(self, x):
        ids = (x[:, :4].abs() * 3).long().clamp(max=7)
        return self.head(torch.tanh(self.embedding(ids).mean(1) + self.dense(x)))


class Tied(nn.Module):
    """One Linear applied twice, and an output layer sharing the input layer's weight."""

    def __init__(self):
        super().__init__()
        self.shared = nn.Linear(12, 12)
        self.head = nn.Linear(12, 3)

    def forward(self, x):
        return self.head(torch.tanh(self.shared(torch.tanh(self.shared(x)))))


class Counting(nn.Module):
    """A buffer the forward updates in training (a running mean of the inputs), and a plain attribute it reads."""

    def __init__(self):
        super().__init__()
        self.register_buffer("running", torch.zeros(12))
        self.body = nn.Sequential(nn.Linear(12, 16), nn.Tanh(), nn.Dropout(0.2), nn.Linear(16, 3))
        self.scale = 1.0

    def forward(self, x):
        if self.training:
            self.running.mul_(0.9).add_(x.detach().mean(0), alpha=0.1)
        return self.body(x - self.running) * self.scale


def _nets() -> dict:
    return {
        "mlp": lambda: nn.Sequential(nn.Linear(12, 16), nn.Tanh(), nn.Linear(16, 3)),
        # no bias right before a BatchNorm: training cancels it (a zero gradient plus rounding noise, which Adam turns
        # into full-size steps that differ run to run), but the running mean, and so evaluation, follows it
        "batchnorm-dropout": lambda: nn.Sequential(nn.Linear(12, 16, bias=False), nn.BatchNorm1d(16), nn.ReLU(),
                                                   nn.Dropout(0.3), nn.Linear(16, 3)),
        "conv1d": lambda: nn.Sequential(Reshaped(2, 6), nn.Conv1d(2, 4, 3), nn.Tanh(), nn.Flatten(),
                                        nn.Linear(16, 3)),
        "conv2d-batchnorm": lambda: nn.Sequential(Reshaped(1, 3, 4), nn.Conv2d(1, 4, 2, bias=False), nn.BatchNorm2d(4),
                                                  nn.Tanh(), nn.Flatten(), nn.Linear(24, 3)),
        "layernorm": lambda: nn.Sequential(nn.Linear(12, 16), nn.LayerNorm(16), nn.GELU(), nn.Linear(16, 3)),
        "groupnorm": lambda: nn.Sequential(nn.Linear(12, 16), nn.GroupNorm(4, 16), nn.Tanh(), nn.Linear(16, 3)),
        "embedding": Bagged,
        "gru": lambda: nn.Sequential(Reshaped(-1, 4), LastStep(nn.GRU(4, 8, batch_first=True)), nn.Linear(8, 3)),
        "lstm": lambda: nn.Sequential(Reshaped(-1, 4), LastStep(nn.LSTM(4, 8, batch_first=True)), nn.Linear(8, 3)),
        "transformer": lambda: nn.Sequential(Reshaped(-1, 4), nn.Linear(4, 8), nn.TransformerEncoderLayer(
            8, 2, 16, dropout=0.1, batch_first=True), MeanOverTime(), nn.Linear(8, 3)),
        "attention": lambda: nn.Sequential(Reshaped(-1, 4), nn.Linear(4, 8), SelfAttention(), MeanOverTime(),
                                           nn.Linear(8, 3)),
        "tied": Tied,
        "buffer-in-forward": Counting,
    }


class SelfAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.attention = nn.MultiheadAttention(8, 2, batch_first=True)

    def forward(self, x):
        return self.attention(x, x, x, need_weights=False)[0]


NETS = _nets()
OPTIMIZERS = {
    "sgd": lambda p: torch.optim.SGD(p, lr=0.05),
    "sgd-momentum": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9),
    "sgd-nesterov": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, nesterov=True),
    "sgd-weight-decay": lambda p: torch.optim.SGD(p, lr=0.05, weight_decay=1e-2),
    "adam": lambda p: torch.optim.Adam(p, lr=1e-2),
    "adamw": lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=1e-2),
    "adam-amsgrad": lambda p: torch.optim.Adam(p, lr=1e-2, amsgrad=True),
    "rmsprop": lambda p: torch.optim.RMSprop(p, lr=1e-3),   # stepped apart from the traced step
}
SCHEDULES = ("none", "per-epoch", "per-step", "warmup", "plateau", "lambda")
CHANGES = ("none", "freeze-unfreeze", "attribute", "submodule-eval", "dropout-p", "learning-rate")


@dataclasses.dataclass(frozen=True)
class Config:
    net: str
    optimizer: str
    precision: str
    accumulate: int
    clip: float | None
    weights: str
    steps_per_execution: int | str
    batch_size: int
    data: str
    schedule: str
    change: str
    validation: bool

    def __str__(self) -> str:
        return "-".join(str(value) for value in dataclasses.astuple(self))

    @property
    def family(self) -> tuple:
        """What shapes the compiled programs (the fields before `schedule`): the configurations of a family share
        one Model, as a user fitting one model again does, and compile once."""
        return dataclasses.astuple(self)[:FAMILY_FIELDS]

    @property
    def well_conditioned(self) -> bool:
        """Whether weights are compared too: SGD's updates carry a difference of rounding as it is, where Adam
        divides a near-zero gradient (a bias before a normalisation) by its own small running size."""
        return self.optimizer.startswith("sgd")


FAMILY_FIELDS = 9
#: nets that read their features as a sequence of steps of 4 (the only ones a batch of 8 features fits)
SEQUENCE_NETS = ("gru", "lstm", "transformer", "attention")
#: nets torch itself cannot train in bf16-mixed on every CPU, eagerly or compiled: its LSTM under CPU bf16 autocast
#: fails in oneDNN ("could not create a primitive descriptor") on CPUs without AVX-512; torch.compile runs
#: TransformerEncoderLayer's evaluation fast path under CPU autocast where eager does not (other dtypes, then "expected
#: m1 and m2 to have the same dtype" in the layer after it)
TORCH_CANNOT_BF16 = ("lstm", "transformer")
#: what a family's configurations vary: the schedule, the change between epochs and validation
VARIATIONS = list(itertools.product(SCHEDULES, CHANGES, (False, True)))


def draw_family(rng: random.Random) -> tuple:
    net, optimizer = rng.choice(sorted(NETS)), rng.choice(sorted(OPTIMIZERS))
    several = (1, "auto", "auto", 3) if optimizer != "rmsprop" else (1, "auto")   # its update is not traced
    precision = rng.choice(("32-true", "32-true", "bf16-mixed"))
    if net in TORCH_CANNOT_BF16:
        precision = "32-true"
    data = rng.choice(("tensors", "tensors", "loader", "lengths"))
    if data == "lengths" and net not in SEQUENCE_NETS:
        data = "loader"
    weights = rng.choice(("none", "none", "class", "sample")) if data == "tensors" else "none"   # weights: tensors
    return (net, optimizer, precision, rng.choice((1, 1, 2)), rng.choice((None, None, 0.5)), weights,
            rng.choice(several), rng.choice((8, 10, 16)), data)


def families(count: int, members: int, seed: int) -> list[list[Config]]:
    """`count` families of `members` configurations each (distinct variations of one drawn family). A family drawn
    again is replaced by one drawn from a second stream, so that no two families test the same programs and every
    other family stays as the seed drew it."""
    rng, redraw = random.Random(seed), random.Random(seed + 1)
    drawn, seen = [], set()
    for _ in range(count):
        family, variations = draw_family(rng), rng.sample(VARIATIONS, members)
        while family in seen:
            family = draw_family(redraw)
        seen.add(family)
        drawn.append([Config(*family, *variation) for variation in variations])
    return drawn


def data() -> tuple[torch.Tensor, torch.Tensor]:
    """60 samples, 12 features, 3 classes a small net learns."""
    x = torch.randn(60, 12, generator=torch.Generator().manual_seed(0))
    return x, (x[:, 0] > 0).long() + (x[:, 1] > 0.5).long()


class ShorterEveryOtherBatch:
    """A collate function whose batches are whole sequences (12 features: 3 steps of 4) or the first 2 steps (8
    features), by their first sample, as a padding collator's lengths change from batch to batch. Like a padding
    collator it keeps no state: under compile= the first batch may be read once ahead of the fit."""

    def __call__(self, samples):
        x, y = (torch.stack(column) for column in zip(*samples))
        return (x if x[0, 0] > 0 else x[:, :8]), y


def training_data(config: Config, x: torch.Tensor, y: torch.Tensor) -> tuple:
    """fit's data as the configuration gives it: (x, y) for tensors, (loader,) for a DataLoader."""
    if config.data == "tensors":
        return x, y
    collate = ShorterEveryOtherBatch() if config.data == "lengths" else None
    return (DataLoader(TensorDataset(x, y), batch_size=config.batch_size, collate_fn=collate),)


class ChangeBetweenEpochs(Callback):
    """What a callback changes from the second epoch on."""

    def __init__(self, change: str):
        self.change = change

    def on_epoch_begin(self, epoch, logs=None):
        if epoch == 0 or self.change == "none":
            return
        net = self.model.net
        first = next(module for module in net.modules() if isinstance(module, (nn.Linear, nn.Conv1d, nn.Conv2d,
                                                                               nn.Embedding)))
        if self.change == "freeze-unfreeze":
            first.requires_grad_(epoch % 2 == 0)
        elif self.change == "attribute":
            net.extra_scale = 1.0 + 0.5 * epoch
        elif self.change == "submodule-eval":
            for module in net.modules():
                if isinstance(module, (nn.Dropout, nn.BatchNorm1d, nn.BatchNorm2d)):
                    module.eval()
        elif self.change == "dropout-p":
            for module in net.modules():
                if isinstance(module, nn.Dropout):
                    module.p = 0.5
        elif self.change == "learning-rate":
            for group in self.model.optimizer.param_groups:
                group["lr"] = group["lr"] * 0.5


class ScaledOutput(nn.Module):
    """The net's output times `extra_scale`, an attribute a callback may change."""

    def __init__(self, net: nn.Module):
        super().__init__()
        self.net = net
        self.extra_scale = 1.0

    def forward(self, x):
        return self.net(x) * self.extra_scale


def new_model(config: Config) -> easyfit.Model:
    """The configuration's model, its net built from seed 0."""
    torch.manual_seed(0)
    return easyfit.Model(ScaledOutput(NETS[config.net]()), "cross_entropy", OPTIMIZERS[config.optimizer],
                         metrics=["accuracy"])


def reset(net: nn.Module, fresh: nn.Module) -> None:
    """`net` as `fresh` (the same architecture) was built: its weights, and every plain setting of every module
    that a previous fit's callback may have changed (training flags, a Dropout's p, attributes, requires_grad)."""
    net.load_state_dict(fresh.state_dict())
    for module, new in zip(net.modules(), fresh.modules()):
        for name, value in vars(new).items():
            if isinstance(value, (bool, int, float)) and not name.startswith("_"):
                setattr(module, name, value)
    for param, new in zip(net.parameters(), fresh.parameters()):
        param.requires_grad_(new.requires_grad)


def fit(config: Config, compile, model: easyfit.Model | None = None) -> tuple[nn.Module, dict]:
    """The configuration's fit, eager (compile=False) or compiled: the trained net and the History. `model`: one of
    the configuration's family that earlier fits compiled for; its net is reset to the fresh net and `compile()`
    gives it this configuration's optimizer and schedule (and its own loss module), as a user fitting a model again
    does."""
    fresh = new_model(config)   # draws the net's initial weights from seed 0 either way
    if model is None:
        model = fresh
    else:
        reset(model.net, fresh.net)
    scheduler, interval = None, "epoch"
    if config.schedule in ("per-epoch", "per-step"):
        scheduler = lambda optimizer: torch.optim.lr_scheduler.StepLR(optimizer, 2, 0.5)   # noqa: E731
        interval = config.schedule.removeprefix("per-")
    model.compile(OPTIMIZERS[config.optimizer], model.loss_fn, ["accuracy"], scheduler=scheduler,
                  scheduler_interval=interval)
    x, y = data()
    callbacks = [ChangeBetweenEpochs(config.change)]
    if config.schedule == "plateau":
        callbacks.append(ReduceLROnPlateau("loss", factor=0.5, patience=0))
    if config.schedule == "lambda":
        callbacks.append(LearningRateScheduler(lambda epoch, lr: lr * 0.7))
    options = {"class_weight": {0: 0.5, 1: 1.0, 2: 2.0}} if config.weights == "class" else \
        {"sample_weight": torch.linspace(0.2, 2.0, len(x))} if config.weights == "sample" else {}
    if compile is not False:
        options["steps_per_execution"] = config.steps_per_execution
    if config.data == "tensors":   # a DataLoader batches by itself
        options["batch_size"] = config.batch_size
    history = model.fit(*training_data(config, x, y), epochs=3, verbose=0, compile=compile,
                        precision=config.precision, gradient_accumulation_steps=config.accumulate,
                        gradient_clip_val=config.clip, lr_warmup_epochs=1 if config.schedule == "warmup" else 0,
                        validation_data=(x[:15], y[:15]) if config.validation else None, callbacks=callbacks,
                        **options)
    return model.net, history.history
