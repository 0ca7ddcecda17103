"""A caller for test_spawn_lifetime.py, to be killed: OUT STRATEGY [seeded] (ddp_spawn / ddp_fork / ddp_notebook).

With "seeded", first three short 2-rank seeded fits of a net with Dropout (seeds 1, 1, 2), in a thread that ends before
the next fit: each one's trained weights, the first numbers rank 0 drew from Python's `random`, numpy and torch, and
its parent's pid go to OUT/seeded.pt. Then a 3-rank fit that
runs until the caller is killed: each rank writes OUT/rank-<pid>.json (its pid and its parent's) as its training
begins; then rank 0 rewrites OUT/checkpoint.pt atomically again and again, while ranks 1 and 2 wait in a receive
from each other that never completes (inside gloo, where Python's signal handlers do not run)."""
import json
import os
import random
import sys
import threading
from pathlib import Path

import numpy as np
import torch
from torch import nn

import easyfit
from easyfit.callbacks import Callback
from easyfit.saving.checkpoint import save_file_atomically


class FirstDraws(Callback):
    def on_train_begin(self, logs=None):
        self.draws = (random.random(), float(np.random.rand()), torch.rand(1).item())
        self.parent = os.getppid()


class Running(Callback):
    def __init__(self, out: Path):
        self.out = out

    def on_train_begin(self, logs=None):
        rank = self.model.global_rank
        if rank == 0:
            save_file_atomically(self.out / "checkpoint.pt", {"data": torch.arange(200_000)})
        path = self.out / f"rank-{os.getpid()}.json"
        path.with_suffix(".tmp").write_text(json.dumps({"pid": os.getpid(), "parent": os.getppid()}))
        os.replace(path.with_suffix(".tmp"), path)
        while rank == 0:
            save_file_atomically(self.out / "checkpoint.pt", {"data": torch.arange(200_000)})
        torch.distributed.recv(torch.zeros(1), src=3 - rank)


def make_model() -> easyfit.Model:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 32), nn.Tanh(), nn.Dropout(0.5), nn.Linear(32, 3))
    return easyfit.Model(net, "cross_entropy", "sgd")


def seeded_fits(x, y, strategy: str) -> list:
    results = []
    for seed in (1, 1, 2):
        model = make_model()
        torch.manual_seed(seed)
        np.random.seed(seed)
        random.seed(seed)
        draws = FirstDraws()
        model.fit(x, y, epochs=2, batch_size=16, verbose=0, callbacks=[draws], devices=2, accelerator="cpu",
                  strategy=strategy)
        results.append({"weights": model.net.state_dict(), "draws": draws.draws, "parent": draws.parent})
    return results


if __name__ == "__main__":
    out, strategy = Path(sys.argv[1]), sys.argv[2]
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(64, 6, generator=generator)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 1).long()
    if sys.argv[3:] == ["seeded"]:
        results = []
        thread = threading.Thread(target=lambda: results.extend(seeded_fits(x, y, strategy)))
        thread.start()
        thread.join()
        torch.save(results, out / "seeded.pt")
    make_model().fit(x, y, epochs=1, batch_size=8, verbose=0, callbacks=[Running(out)], devices=3, accelerator="cpu",
                     strategy=strategy)
