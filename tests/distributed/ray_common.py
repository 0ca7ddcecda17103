"""What the Ray test modules share: the session's local Ray cluster (two nodes of one CPU, tests/ray_cluster.py), the
data, the net and plain PyTorch on the combined batch they are compared with."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from ray_cluster import joined
from torch import nn

SAMPLES, BATCH, LR, EPOCHS = 40, 8, 0.1, 3


def on_the_cluster(module_name: str, ray_cluster):
    """A module fixture's body: the module's tests join the session's Ray cluster (tests/ray_cluster.py); its own
    classes and functions, and this module's, travel to the workers by value."""
    yield from joined(ray_cluster, module_name, __name__)


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
