"""What the Ray test modules share: one local Ray cluster per module (2 CPUs, no dashboard), the data, the net and
plain PyTorch on the combined batch they are compared with."""
from __future__ import annotations

import os
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

SAMPLES, BATCH, LR, EPOCHS = 40, 8, 0.1, 3


def start_cluster(module_name: str, nodes: int = 1):
    """A module fixture's body: a local cluster of 2 CPUs for the module's tests (one node, or `nodes` of one CPU
    each on this machine, as Ray's own tests make them), shut down at its end; the test module's own classes and
    functions travel to the workers by value (they are not importable there)."""
    ray = pytest.importorskip("ray", reason='launcher="ray" needs Ray: pip install "easyfit[ray]"')
    pytest.importorskip("ray.train", reason='launcher="ray" needs Ray Train: pip install "easyfit[ray]"')
    from ray import cloudpickle
    from ray.cluster_utils import Cluster
    cloudpickle.register_pickle_by_value(sys.modules[module_name])
    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    cluster = None
    if nodes == 1:
        ray.init(num_cpus=2, include_dashboard=False)
    else:
        cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
        for _ in range(nodes - 1):
            cluster.add_node(num_cpus=1)
        ray.init(address=cluster.address)
    try:
        yield ray
    finally:
        ray.shutdown()
        if cluster is not None:
            cluster.shutdown()


def make_data(samples: int = SAMPLES):
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(samples, 4, generator=generator)
    return x, (x[:, :1] * 0.7 - x[:, 1:2] * 0.3 + 0.1 * torch.randn(samples, 1, generator=generator))


def make_net() -> nn.Module:
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))


def plain_fit(x, y, batch: int, epochs: int = EPOCHS, lr: float = LR) -> tuple[list[float], dict]:
    """Plain PyTorch: SGD on batches of `batch` in order; the epoch loss is the mean over its samples."""
    net = make_net()
    optimizer = torch.optim.SGD(net.parameters(), lr=lr)
    losses = []
    for _ in range(epochs):
        total = 0.0
        for inputs, target in zip(x.split(batch), y.split(batch)):
            loss = F.mse_loss(net(inputs), target)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            total += float(loss.detach()) * len(inputs)
        losses.append(total / len(x))
    return losses, net.state_dict()


def assert_like_plain(history, net, expected) -> None:
    losses, weights = expected
    assert history.history["loss"] == pytest.approx(losses, abs=1e-5)
    for name, value in net.state_dict().items():
        torch.testing.assert_close(value, weights[name], atol=1e-5, rtol=0)
