"""What the tests of the callbacks around the fit share: running tests/callbacks/scripts/around.py on 2 CPU
processes, which libraries are here, and the plain-PyTorch EMA those runs are compared with."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).parent / "scripts" / "around.py"
#: a finished launch's standard error, in its folder
STDERR_FILE = "stderr.txt"
sys.path.insert(0, str(Path(__file__).parents[1] / "distributed" / "scripts"))
from common import make_data, make_net

HAVE = {name: importlib.util.find_spec(name) is not None for name in ("mlflow", "wandb", "optuna")}
NEEDS_MLFLOW = pytest.mark.skipif(not HAVE["mlflow"], reason="pip install easyfit[mlflow]")
NEEDS_WANDB = pytest.mark.skipif(not HAVE["wandb"], reason="pip install easyfit[wandb]")
NEEDS_OPTUNA = pytest.mark.skipif(not HAVE["optuna"], reason="pip install easyfit[optuna]")


def available_checks() -> list[str]:
    """The checks of around.py whose libraries are installed."""
    checks = ["ema", "swa", "throughput", "profiler"]
    if HAVE["mlflow"] and HAVE["wandb"]:
        checks.append("tracking")
    if HAVE["optuna"]:
        checks.append("optuna")
    return checks


def run_around(out: Path, strategy: str, checks: list[str], timeout: float = 500) -> dict:
    """{check: [rank 0's result, rank 1's result]} (one result with a spawning strategy), and the launch's stderr."""
    return run_around_each(out, [strategy], checks, timeout)[strategy]


def run_around_each(out: Path, strategies: list[str], checks: list[str], timeout: float = 500) -> dict:
    """One launch that runs the checks under each strategy in turn: {strategy: what run_around returns}."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_SILENT": "true", "WANDB_MODE": "offline"}
    process = subprocess.run([sys.executable, str(SCRIPT), str(out), ",".join(strategies), ",".join(checks)],
                             env=env, cwd=out, capture_output=True, text=True, timeout=timeout)
    assert process.returncode == 0, process.stderr[-6000:]
    (out / STDERR_FILE).write_text(process.stderr)
    return read_around(out, strategies, checks)


def read_around(out: Path, strategies: list[str], checks: list[str]) -> dict:
    """What run_around_each returned, read again from the folder of its finished launch."""
    return {strategy: {**{check: [torch.load(path, weights_only=False)
                                  for path in sorted(out.glob(f"result-{strategy}-{check}-*.pt"))]
                          for check in checks}, "stderr": (out / STDERR_FILE).read_text()}
            for strategy in strategies}


def hand_ema(epochs: int, decay: float, lr: float = 0.1, batch: int = 32, every: int = 1) -> tuple[dict, list]:
    """Plain PyTorch: SGD on `batch` samples per step (both ranks' batches of 16 together), no shuffling, and the EMA
    of the weights after every `every`-th step (the first update takes the weights). Returns (the averages, the
    validation loss of the averages on the first 64 samples after each epoch)."""
    x, y = make_data()
    net = make_net()
    optimizer = torch.optim.SGD(net.parameters(), lr=lr)
    averaged, losses, steps = None, [], 0
    for _ in range(epochs):
        for start in range(0, len(x), batch):
            loss = torch.nn.functional.cross_entropy(net(x[start:start + batch]), y[start:start + batch])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            steps += 1
            if steps % every:
                continue
            current = {key: value.detach().clone() for key, value in net.state_dict().items()}
            averaged = current if averaged is None else \
                {key: decay * averaged[key] + (1 - decay) * current[key] for key in current}
        probe = make_net()
        probe.load_state_dict(averaged)
        with torch.no_grad():
            losses.append(torch.nn.functional.cross_entropy(probe(x[:64]), y[:64]).item())
    return averaged, losses


def hand_swa(epochs: int, swa_lr: float, start_epoch: int, annealing_epochs: int, lr: float = 0.1) -> dict:
    """Plain PyTorch: SGD on 32 samples per step, no shuffling; from `start_epoch` SWALR (cos) and the equal average
    of the weights at the end of each epoch."""
    from torch.optim.swa_utils import SWALR
    x, y = make_data()
    net = make_net()
    optimizer = torch.optim.SGD(net.parameters(), lr=lr)
    averaged, count, scheduler = None, 0, None
    for epoch in range(epochs):
        if epoch >= start_epoch and scheduler is None:
            scheduler = SWALR(optimizer, swa_lr=swa_lr, anneal_epochs=annealing_epochs)
        for start in range(0, len(x), 32):
            loss = torch.nn.functional.cross_entropy(net(x[start:start + 32]), y[start:start + 32])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        if epoch >= start_epoch:
            current = {key: value.detach().clone() for key, value in net.state_dict().items()}
            averaged = current if averaged is None else \
                {key: averaged[key] + (current[key] - averaged[key]) / (count + 1) for key in current}
            count += 1
            scheduler.step()
    return averaged


def max_difference(actual: dict, expected: dict) -> float:
    return max((actual[key].cpu() - value).abs().max().item() for key, value in expected.items())
