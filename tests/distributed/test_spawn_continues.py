"""Under ddp_spawn the caller continues where rank 0's random draws ended: a fit of 2 epochs and a second one to 4
equal one fit of 4, bit for bit, with Dropout (4 + 4 epochs equal 8)."""
from __future__ import annotations

import torch
from torch import nn

import easyfit

SPAWN = {"devices": 2, "accelerator": "cpu", "strategy": "ddp_spawn", "verbose": 0, "batch_size": 8,
         "shuffle": False}


def trained(splits: list[tuple[int, int]]) -> dict:
    torch.manual_seed(3)
    net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Dropout(0.3), nn.Linear(16, 3))
    x, y = torch.randn(32, 6, generator=torch.Generator().manual_seed(0)), torch.arange(32) % 3
    model = easyfit.Model(net, "cross_entropy", "sgd", lr=0.1)
    for initial_epoch, epochs in splits:
        model.fit(x, y, epochs=epochs, initial_epoch=initial_epoch, **SPAWN)
    return {name: value.clone() for name, value in net.state_dict().items()}


def test_two_spawned_fits_continue_as_one_with_dropout():
    straight, continued = trained([(0, 4)]), trained([(0, 2), (2, 4)])
    for name, value in straight.items():
        assert torch.equal(continued[name], value), name
