"""ddp_spawn pickles what it sends to new processes; what cannot be pickled is named by its attribute path.

The check runs before any process starts, so each case is fast and leaves no child behind.
"""
from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import Dataset

import easyfit
from easyfit.callbacks import Callback
from easyfit.distributed.pickling import find_unpicklable

pytestmark = pytest.mark.timeout(30)
FIX = "or use strategy='ddp' (script re-launch) or 'ddp_fork', which do not pickle"


class Head(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 2)
        self.act = lambda tensor: tensor.relu()

    def forward(self, x):
        return self.act(self.linear(x))


class FileDataset(Dataset):
    """A dataset that keeps its source file open."""

    def __init__(self, path: Path):
        self.source = open(path)
        self.x = torch.randn(8, 4)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index):
        return self.x[index], 0


class Locked(Callback):
    def __init__(self):
        self.lock = threading.Lock()


def children() -> set[int]:
    """Live child processes of this one (Linux), leaving out multiprocessing's resource tracker (a helper)."""
    pids = set()
    for task in Path(f"/proc/{os.getpid()}/task").iterdir():
        for pid in (task / "children").read_text().split():
            try:
                command = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:   # it ended meanwhile
                continue
            if b"resource_tracker" not in command:
                pids.add(int(pid))
    return pids


def make_model(net: nn.Module | None = None, loss="cross_entropy") -> easyfit.Model:
    return easyfit.Model(net if net is not None else nn.Linear(4, 2), loss, "sgd")


def assert_names(path: str, call) -> None:
    """`call(strategy_options)` fails at once with a TypeError naming `path` and the strategies that do not pickle."""
    before = children()
    with pytest.raises(TypeError) as error:
        call(dict(devices=2, accelerator="cpu", strategy="ddp_spawn", verbose=0))
    assert error.traceback[-1].name == "check_picklable", "raised by the check that runs before spawning"
    assert children() == before
    message = str(error.value)
    assert f"cannot be pickled: {path}: <" in message, message
    assert FIX in message


def xy() -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(8, 4), torch.zeros(8, dtype=torch.long)


def test_a_lambda_in_a_submodule():
    net = nn.Sequential()
    net.add_module("head", Head())
    assert_names("net.head.act", lambda run: make_model(net).fit(*xy(), **run))


def test_a_lambda_in_a_dict_attribute_of_the_net():
    net = nn.Linear(4, 2)
    net.config = {"init": lambda tensor: tensor}
    assert_names("net.config['init']", lambda run: make_model(net).fit(*xy(), **run))


def test_a_lambda_forward_hook():
    net = nn.Linear(4, 2)
    handle = net.register_forward_hook(lambda module, inputs, output: None)   # hook ids count per process
    assert_names(f"net._forward_hooks[{handle.id}]", lambda run: make_model(net).fit(*xy(), **run))


def test_a_local_lambda_as_the_loss():
    def local_loss():
        return lambda output, target: nn.functional.cross_entropy(output, target)
    assert_names("loss_fn", lambda run: make_model(loss=local_loss()).fit(*xy(), **run))


def test_a_dataset_holding_an_open_file(tmp_path):
    (tmp_path / "source.txt").write_text("samples")
    data = FileDataset(tmp_path / "source.txt")
    try:
        assert_names("x.source", lambda run: make_model().fit(data, **run))
        assert_names("x.source", lambda run: make_model().predict(data, **run))
        assert_names("options.validation_data[0].source",
                     lambda run: make_model().fit(*xy(), validation_data=(data, None), **run))
    finally:
        data.source.close()


def test_a_callback_holding_a_lock():
    assert_names("options.callbacks[0].lock", lambda run: make_model().fit(*xy(), callbacks=[Locked()], **run))


def test_an_ordinary_model_is_not_reported():
    net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    model = easyfit.Model(net, "cross_entropy", "adam", metrics=["accuracy"],
                          scheduler=lambda optimizer: torch.optim.lr_scheduler.StepLR(optimizer, 2))
    assert find_unpicklable(model, "model") is None
