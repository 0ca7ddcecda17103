"""strategy="auto" shards when one replica of the training state would not fit a device: the estimate of the
parameter, gradient and optimizer-state bytes, the device memory it is compared with (faked here), and the words."""
from __future__ import annotations

import ast
import os
import subprocess
import sys
import types

import pytest
import torch
from test_connector import CPU2, gpus, notebook, plain_script  # noqa: F401 (fixtures)

from easyfit.distributed import calls, connector, memory
from easyfit.distributed.connector import connect
from easyfit.distributed.environments import detect_environment
from easyfit.distributed.strategies.ddp import DDPStrategy
from easyfit.distributed.strategies.fsdp import FSDPStrategy
from easyfit.distributed.strategies.single import SingleDeviceStrategy
from easyfit.parts.lr_scaling import describe

GB = 10 ** 9


def net() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(10, 20), torch.nn.ReLU(), torch.nn.Linear(20, 5))   # 325 parameters


@pytest.fixture
def memory_of(monkeypatch):
    """Fake the bytes each device has."""
    def fake(size: int) -> None:
        monkeypatch.setattr(memory, "device_memory", lambda accelerator, devices, processes: size)
    return fake


@pytest.mark.parametrize("optimizer, copies", [
    (lambda p: torch.optim.Adam(p), 2), (lambda p: torch.optim.AdamW(p), 2), (lambda p: torch.optim.SGD(p, 0.1), 0),
    (lambda p: torch.optim.SGD(p, 0.1, momentum=0.9), 1), (lambda p: torch.optim.RMSprop(p), 1),
    (lambda p: torch.optim.RMSprop(p, momentum=0.9, centered=True), 3), (lambda p: torch.optim.Adagrad(p), 1)])
def test_the_estimate_counts_parameters_gradients_and_each_optimizer_state_copy(optimizer, copies):
    module = net()
    found = memory.estimate(module, optimizer(module.parameters()))
    assert (found.parameters, found.gradients, found.optimizer_state) == (325 * 4, 325 * 4, copies * 325 * 4)
    assert found.total == (2 + copies) * 1300


def test_frozen_parameters_have_no_gradient_nor_optimizer_state():
    module = net()
    module[0].requires_grad_(False)
    found = memory.estimate(module, torch.optim.Adam(module[2].parameters()))
    assert (found.parameters, found.gradients, found.optimizer_state) == (1300, 105 * 4, 2 * 105 * 4)


def test_auto_picks_fsdp_when_the_state_does_not_fit_and_says_why(memory_of):
    memory_of(24 * GB)
    state = memory.TrainingMemory(10 * GB, 10 * GB, 18.2 * GB, "Adam")
    strategy = connect("auto", **CPU2, training_memory=state)
    assert isinstance(strategy, FSDPStrategy) and strategy.name == "fsdp" and strategy.world_size == 2
    assert strategy.auto_reason == "model + Adam state 38.2 GB > 24 GB per device: using fsdp"
    optimizer = torch.optim.Adam(net().parameters(), lr=0.1)
    assert describe(16, strategy, None, optimizer, 1.0).startswith(
        "model + Adam state 38.2 GB > 24 GB per device: using fsdp; effective batch 32 = 16 × 2 processes")


def test_auto_keeps_ddp_when_the_state_fits_and_single_on_one_device(memory_of):
    memory_of(24 * GB)
    fits = memory.TrainingMemory(4 * GB, 4 * GB, 8 * GB, "Adam")
    too_big = memory.TrainingMemory(40 * GB, 40 * GB, 80 * GB, "Adam")
    chosen = connect("auto", **CPU2, training_memory=fits)
    assert type(chosen) is DDPStrategy and chosen.auto_reason is None
    assert isinstance(connect("auto", devices=1, accelerator="cpu", training_memory=too_big), SingleDeviceStrategy)
    assert type(connect("ddp", **CPU2, training_memory=too_big)) is DDPStrategy, "an explicit name is obeyed"
    assert type(connect("auto", **CPU2)) is DDPStrategy, "evaluate / predict pass no estimate"


def test_in_a_notebook_the_sharded_choice_forks_its_ranks(memory_of, notebook):  # noqa: F811
    memory_of(1 * GB)
    strategy = connect("auto", **CPU2, training_memory=memory.TrainingMemory(GB, GB, 2 * GB, "SGD"))
    assert isinstance(strategy, FSDPStrategy) and strategy.start_method == "fork"


def test_gpu_memory_is_the_smallest_device_total(gpus, monkeypatch):  # noqa: F811
    totals = {0: 80 * GB, 1: 24 * GB, 2: 80 * GB}
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: types.SimpleNamespace(
        total_memory=totals[index]))
    devices = [torch.device("cuda", i) for i in (0, 1)]
    assert memory.device_memory("cuda", devices, 2) == 24 * GB
    state = memory.TrainingMemory(10 * GB, 10 * GB, 10 * GB, "Adam")
    assert connector.auto_strategy_name(calls.Call("cuda", devices, 1, detect_environment(), None,
                                                       False), state)[0] == "fsdp"


def test_cpu_memory_is_the_machine_ram_shared_by_its_processes():
    ram = memory.device_memory("cpu", [torch.device("cpu")], 1)
    assert ram > 0 and memory.device_memory("cpu", [torch.device("cpu")] * 2, 2) == ram // 2


FORKED_FIT = """
import torch, easyfit
from easyfit.distributed import calls, memory
memory.device_memory = lambda accelerator, devices, processes: 1000   # smaller than the state: 5200 bytes
calls.is_interactive = lambda: True                                  # forked ranks, as in a notebook
torch.manual_seed(0)
x, y = torch.randn(64, 10), torch.randint(0, 5, (64,))
net = torch.nn.Sequential(torch.nn.Linear(10, 20), torch.nn.ReLU(), torch.nn.Linear(20, 5))
model = easyfit.Model(net, "cross_entropy", "adam", lr=0.01)
history = model.fit(x, y, epochs=2, batch_size=16, devices=2, accelerator="cpu", verbose=1, lr_scaling=None)
print("LOSSES", history.history["loss"])
"""


def test_fit_passes_its_estimate_and_prints_why_it_shards():
    """A real fit on 2 forked CPU ranks whose faked memory is smaller than its state: it trains under fsdp. (A fresh
    interpreter: forking a test process that other tests left with threads can hang.)"""
    process = subprocess.run([sys.executable, "-c", FORKED_FIT], capture_output=True, text=True, timeout=240,
                             env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert process.returncode == 0, process.stderr[-4000:]
    assert "model + Adam state 5.2e-06 GB > 1e-06 GB per device: using fsdp" in process.stdout
    losses = ast.literal_eval(process.stdout.split("LOSSES", 1)[1].strip())
    assert losses[-1] < losses[0]
