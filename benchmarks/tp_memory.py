"""Bytes of parameters and optimizer state each rank holds under strategy="tp" (tensor_parallel_size 2, plan "auto")
against plain PyTorch on one process, for an MLP and a small transformer language model.

    python benchmarks/tp_memory.py

Each net trains one step with AdamW on 2 CPU processes (gloo; the script re-runs itself as rank 1). Counted on each
rank after the first step, from the tensors it holds (a DTensor's local slice; easyfit's `rank_memory`); plain
PyTorch's figure is the same count for the whole net after one step in this process. The bar: at most 0.55x.
"""
from __future__ import annotations

import functools
import os
import sys

import torch
from torch import nn

import easyfit
from easyfit.distributed.environments import launch_identity
from easyfit.distributed.strategy_parts.sharding import rank_memory
from easyfit.parts.losses import resolve_loss

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "distributed", "scripts"))
from tensor_parallel import TinyLM, lm_loss

BAR = 0.55
VOCAB, DIM, LENGTH = 1024, 256, 16   # the LM: 2 encoder layers of 4 heads, an output layer tied to the embedding


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 1024), nn.GELU(), nn.Linear(1024, 1024), nn.GELU(), nn.Linear(1024, 64))


def tokens() -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randint(0, VOCAB, (8, LENGTH)), torch.randint(0, VOCAB, (8, LENGTH))


CASES = {"MLP 64-1024-1024-64": (mlp, lambda: (torch.randn(32, 64), torch.randn(32, 64)), "mse"),
         "transformer LM (tied head)": (functools.partial(TinyLM, VOCAB, DIM, 4, 4 * DIM), tokens, lm_loss)}


class Measure(easyfit.callbacks.Callback):
    """Bytes this rank holds after the first optimizer step."""

    def on_train_batch_end(self, batch, logs=None):
        if batch == 0:
            self.bytes = rank_memory(self.model._training.net, self.model.optimizer)


def plain_bytes(build, data, loss) -> int:
    torch.manual_seed(0)
    net = build()
    optimizer = torch.optim.AdamW(net.parameters())
    x, y = data()
    resolve_loss(loss)(net(x), y).backward()
    optimizer.step()
    return sum(rank_memory(net, optimizer).values())


def tp_bytes(build, data, loss) -> tuple[int, str]:
    torch.manual_seed(0)
    net, measure = build(), Measure()
    model = easyfit.Model(net, loss, torch.optim.AdamW(net.parameters()))
    model.fit(*data(), batch_size=8, epochs=1, steps_per_epoch=1, verbose=0, strategy="tp", devices=2,
              accelerator="cpu", callbacks=[measure])
    return sum(measure.bytes.values()), model.strategy.found.describe(build())


def main() -> None:
    torch.set_num_threads(1)
    rows = []
    for name, (build, data, loss) in CASES.items():
        held, plan = tp_bytes(build, data, loss)
        rows.append((name, plain_bytes(build, data, loss), held, plan))
    if launch_identity()[0] != 0:
        return
    print(f"{'net':28s} {'plain PyTorch':>14s} {'tp=2, rank 0':>14s} {'ratio':>6s}")
    for name, plain, held, _ in rows:
        print(f"{name:28s} {plain:14,d} {held:14,d} {held / plain:6.3f}  {'ok' if held / plain <= BAR else 'OVER'}")
    for name, _, _, plan in rows:
        print(f"\n{name}: {plan}")


if __name__ == "__main__":
    main()
