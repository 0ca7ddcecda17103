"""Writing your own callback: subclass easyfit.callbacks.Callback and override the hooks you need.

Two callbacks here:
- `StopAtAccuracy` ends training once the validation accuracy reaches a target (sets model.stop_training).
- `LossSampler` records the batch loss every `every` steps. Batch logs are computed only when read,
  so reading them every 20th step keeps the other steps free of device syncs.

Run:  python examples/custom_callback.py
"""
from __future__ import annotations

import sys

import torch
from quickstart import load_data
from torch import nn

import easyfit
from easyfit.callbacks import Callback


class StopAtAccuracy(Callback):
    """Stop training at the end of the first epoch whose `monitor` value reaches `target`."""

    def __init__(self, target: float, monitor: str = "val_accuracy"):
        self.target, self.monitor = target, monitor
        self.stopped_epoch: int | None = None

    def on_epoch_end(self, epoch, logs=None):
        if logs is not None and logs.get(self.monitor, 0.0) >= self.target:
            self.stopped_epoch = epoch
            self.model.stop_training = True
            if self.model.is_global_zero:   # hooks run in every process; print once
                print(f"{self.monitor} reached {logs[self.monitor]:.4f} in epoch {epoch + 1}: stopping")


class LossSampler(Callback):
    """Keep (epoch, step, batch loss) every `every` training steps."""

    def __init__(self, every: int = 20):
        self.every = every
        self.epoch = 0
        self.samples: list[tuple[int, int, float]] = []

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if batch % self.every == 0:
            self.samples.append((self.epoch, batch, logs["batch_loss"]))


def main() -> int:
    torch.manual_seed(0)
    x_train, x_test, y_train, y_test = load_data()
    net = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
    model = easyfit.Model(net, "cross_entropy", "adam", metrics=["accuracy"])

    stopper, sampler = StopAtAccuracy(target=0.95), LossSampler(every=20)
    history = model.fit(x_train, y_train, epochs=50, batch_size=32, validation_split=0.1, verbose=0,
                        callbacks=[stopper, sampler])

    print(f"trained {len(history.epoch)} of 50 epochs")
    for epoch, step, loss in sampler.samples:
        print(f"  epoch {epoch + 1} step {step}: batch loss {loss:.4f}")
    print(f"test accuracy: {model.evaluate(x_test, y_test, verbose=0, return_dict=True)['accuracy']:.4f}")
    return 0 if stopper.stopped_epoch is not None else 1


if __name__ == "__main__":
    sys.exit(main())
