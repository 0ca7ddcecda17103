"""What both sides of benchmarks/ddp.py share: the net, the data, the settings and the result file."""
from __future__ import annotations

import argparse
import json
import time

import torch
from torch import nn

SIZES = (784, 1024, 1024, 10)
BATCH_SIZE = 128   # per process
LR = 0.01


def make_net() -> nn.Module:
    """The compute-bound MLP 784-1024-1024-10, with the same initial weights in every process."""
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for fan_in, fan_out in zip(SIZES, SIZES[1:]):
        layers += [nn.Linear(fan_in, fan_out), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


def make_data(world_size: int, steps_per_epoch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random inputs and class labels: `steps_per_epoch` batches per process in one epoch."""
    generator = torch.Generator().manual_seed(1)
    samples = world_size * BATCH_SIZE * steps_per_epoch
    return torch.randn(samples, SIZES[0], generator=generator), torch.randint(0, SIZES[-1], (samples,),
                                                                              generator=generator)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", help="JSON file that rank 0 writes its timings to")
    parser.add_argument("--epochs", type=int, required=True)
    parser.add_argument("--steps-per-epoch", type=int, required=True)
    parser.add_argument("--warmup", type=int, required=True, help="steps left out of the throughput")
    return parser.parse_args()


class StepClock:
    """Wall-clock times of the first step, of the step that ends the warmup, and of the end of training."""

    def __init__(self, warmup: int):
        self.warmup, self.steps = warmup, 0
        self.first_step = self.timed_from = self.ended = 0.0

    def step_begins(self) -> None:
        if self.steps == 0:
            self.first_step = time.time()
        if self.steps == self.warmup:
            self.timed_from = time.perf_counter()
        self.steps += 1

    def training_ends(self) -> None:
        self.ended = time.perf_counter()

    def write(self, path: str, world_size: int) -> None:
        timed_steps = self.steps - self.warmup
        result = {"first_step": self.first_step, "timed_steps": timed_steps,
                  "samples_per_second": timed_steps * BATCH_SIZE * world_size / (self.ended - self.timed_from)}
        with open(path, "w", encoding="utf-8") as file:
            json.dump(result, file)
