"""Every strategy on one CUDA device trains the weights plain CUDA PyTorch trains; the peak memory of each is
printed (benchmarks/memory.py --cuda measures it on a large net). Skipped without a GPU, and per backend without its
package."""
from __future__ import annotations

import copy
import importlib.util

import pytest
import torch

import easyfit

pytestmark = pytest.mark.gpu

STRATEGIES = ["single", "dp", "ddp", "fsdp", "fsdp_cpu_offload", "zero", "ddp_sharded", "deepspeed_stage_1",
              "deepspeed_stage_2", "deepspeed_stage_3", "deepspeed_stage_2_offload", "deepspeed_stage_3_offload"]
NEEDS = {"ddp_sharded": "fairscale", "deepspeed": "deepspeed"}


def data() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(200, 32, generator=generator)
    return x, (x[:, :3].sum(dim=1) > 0).long() + (x[:, 3] > 1).long()


def make_net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256),
                               torch.nn.ReLU(), torch.nn.Linear(256, 3))


def plain_cuda(net: torch.nn.Module, x, y, epochs: int = 2, batch_size: int = 32) -> dict:
    net = copy.deepcopy(net).cuda()
    optimizer = torch.optim.Adam(net.parameters(), lr=1e-3)
    for _ in range(epochs):
        for start in range(0, len(x), batch_size):
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(net(x[start:start + batch_size].cuda()),
                                              y[start:start + batch_size].cuda()).backward()
            optimizer.step()
    return {name: value.cpu() for name, value in net.state_dict().items()}


def backend(name: str):
    """ddp on NCCL (at world size 1 every collective refuses a CPU tensor); the others by name."""
    return easyfit.strategies.DDP(process_group_backend="nccl") if name == "ddp" else name


def skip_without_its_package(strategy: str) -> None:
    package = next((package for prefix, package in NEEDS.items() if strategy.startswith(prefix)), None)
    if package is not None and importlib.util.find_spec(package) is None:
        pytest.skip(f"{strategy} needs {package}, which is not installed")


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_every_strategy_on_one_gpu_trains_what_plain_cuda_pytorch_trains(strategy):
    skip_without_its_package(strategy)
    x, y = data()
    net = make_net()
    expected = plain_cuda(net, x, y)
    model = easyfit.Model(net, "cross_entropy", "adam", lr=1e-3, metrics=["accuracy"])
    torch.cuda.reset_peak_memory_stats()
    history = model.fit(x, y, epochs=2, batch_size=32, shuffle=False, verbose=0, accelerator="gpu", devices=1,
                        strategy=backend(strategy))
    peak = torch.cuda.max_memory_allocated() / 2 ** 20
    difference = max((value.cpu() - expected[name]).abs().max().item() for name, value in net.state_dict().items())
    print(f"{strategy:28s} weights vs plain CUDA {difference:.1e}; peak GPU memory {peak:.1f} MiB")
    assert difference <= 1e-5
    assert len(history.history["accuracy"]) == 2
    scores = model.evaluate(x, y, verbose=0, return_dict=True, accelerator="gpu", devices=1,
                            strategy=backend(strategy))
    assert scores["loss"] == pytest.approx(history.history["loss"][-1], abs=0.5)


class WhereTheNetWaits(easyfit.callbacks.Callback):
    """The devices the user's net's parameters and its optimizer's state are on during training and validation."""

    def __init__(self, user_net: torch.nn.Module, user_optimizer: torch.optim.Optimizer):
        super().__init__()
        self.user_net, self.user_optimizer, self.devices = user_net, user_optimizer, set()

    def on_train_batch_end(self, batch, logs=None):
        self.devices |= {parameter.device.type for parameter in self.user_net.parameters()}
        self.devices |= {value.device.type for state in self.user_optimizer.state.values()
                         for value in state.values() if isinstance(value, torch.Tensor) and value.dim() > 0}

    on_test_batch_end = on_train_batch_end


@pytest.mark.parametrize("strategy", ["deepspeed_stage_1", "deepspeed_stage_3", "deepspeed_stage_2_offload", "fsdp",
                                      "fsdp_cpu_offload"])
def test_a_sharding_backend_trains_a_copy_while_the_users_net_waits_on_the_host(strategy):
    """The GPU holds one set of weights and optimizer state, the trained copy's; the user's net and optimizer get
    them back on the GPU at the end of each fit, and a second fit continues from there."""
    skip_without_its_package(strategy)
    x, y = data()
    net = make_net()
    expected = plain_cuda(net, x, y)
    optimizer = torch.optim.Adam(net.parameters(), lr=1e-3)
    waits = WhereTheNetWaits(net, optimizer)
    model = easyfit.Model(net, "cross_entropy", optimizer)
    for _ in range(2):   # the second fit starts from the state the first handed back
        model.fit(x, y, epochs=1, batch_size=32, shuffle=False, verbose=0, accelerator="gpu", devices=1,
                  strategy=strategy, validation_data=(x[:64], y[:64]), callbacks=[waits])
        assert all(parameter.is_cuda for parameter in net.parameters())
    assert waits.devices == {"cpu"}
    assert all(value.is_cuda for state in optimizer.state.values() for value in state.values()
               if isinstance(value, torch.Tensor) and value.dim() > 0)
    difference = max((value.cpu() - expected[name]).abs().max().item() for name, value in net.state_dict().items())
    assert difference <= 1e-5
