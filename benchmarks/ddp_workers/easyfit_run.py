"""The easyfit side: one `fit` call, started as a plain `python easyfit_run.py OUT ...` (easyfit starts rank 1)."""
from __future__ import annotations

import torch
from common import BATCH_SIZE, LR, StepClock, make_data, make_net, parse_args

import easyfit
from easyfit.callbacks import Callback

WORLD_SIZE = 2


class Clock(Callback):
    """Feeds the step times to a StepClock."""

    may_stop_training = False   # never stops training: the ranks need not agree after each step

    def __init__(self, clock: StepClock):
        self.clock = clock

    def on_train_batch_begin(self, batch, logs=None):
        self.clock.step_begins()

    def on_train_end(self, logs=None):
        self.clock.training_ends()


def main() -> None:
    easyfit.launch(devices=WORLD_SIZE, accelerator="cpu")   # rank 1 starts now, while this rank prepares
    args = parse_args()
    torch.set_num_threads(1)
    x, y = make_data(WORLD_SIZE, args.steps_per_epoch)
    model = easyfit.Model(make_net(), "cross_entropy", "sgd", lr=LR)
    clock = StepClock(args.warmup)
    model.fit(x, y, epochs=args.epochs, batch_size=BATCH_SIZE, devices=WORLD_SIZE, accelerator="cpu",
              strategy="ddp", lr_scaling=None, verbose=0, callbacks=[Clock(clock)])
    if model.is_global_zero:
        clock.write(args.out, WORLD_SIZE)


if __name__ == "__main__":
    main()
