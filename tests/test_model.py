"""Model.fit against hand-written PyTorch: parity, accumulation, clipping, optimizers and schedulers."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import easyfit
from easyfit.callbacks import Callback
from easyfit.parts.optimizers import OPTIMIZERS


class LearningRates(Callback):
    """The optimizer's LR seen by each training batch."""

    def __init__(self):
        self.values = []

    def on_train_batch_begin(self, batch, logs=None):
        self.values.append(self.model.optimizer.param_groups[0]["lr"])


def hand_trained(net, x, y, epochs, batch_size, orders, clip=None, lr=0.1) -> nn.Module:
    """Plain PyTorch SGD over the samples in `orders[epoch]`, in batches."""
    optimizer = torch.optim.SGD(net.parameters(), lr=lr)
    for epoch in range(epochs):
        order = orders[epoch]
        for start in range(0, len(order), batch_size):
            idx = order[start:start + batch_size]
            optimizer.zero_grad()
            nn.functional.cross_entropy(net(x[idx]), y[idx]).backward()
            if clip is not None:
                nn.utils.clip_grad_norm_(net.parameters(), clip)
            optimizer.step()
    return net


def easyfit_trained(net, x, y, **fit_kwargs) -> nn.Module:
    easyfit.Model(net, "cross_entropy", "sgd", lr=0.1).fit(x, y, verbose=0, **fit_kwargs)
    return net


def test_parity_with_plain_pytorch_without_shuffle(make_net, classification):
    x, y = classification
    expected = hand_trained(make_net(), x, y, 2, 8, [torch.arange(len(x))] * 2)
    net = easyfit_trained(make_net(), x, y, epochs=2, batch_size=8, shuffle=False)
    torch.testing.assert_close(net.state_dict(), expected.state_dict(), atol=1e-6, rtol=0)


def test_parity_with_plain_pytorch_with_shuffle(make_net, classification):
    """The shuffle order of epoch e is randperm seeded with seed + e."""
    x, y = classification
    orders = [torch.randperm(len(x), generator=torch.Generator().manual_seed(7 + epoch)) for epoch in range(3)]
    expected = hand_trained(make_net(), x, y, 3, 8, orders)
    net = easyfit_trained(make_net(), x, y, epochs=3, batch_size=8, shuffle=True, seed=7)
    torch.testing.assert_close(net.state_dict(), expected.state_dict(), atol=1e-6, rtol=0)


def test_gradient_accumulation_equals_a_larger_batch(make_net, classification):
    x, y = classification[0][:96], classification[1][:96]
    accumulated = easyfit_trained(make_net(), x, y, epochs=2, batch_size=8, shuffle=False,
                                  gradient_accumulation_steps=2)
    large = easyfit_trained(make_net(), x, y, epochs=2, batch_size=16, shuffle=False)
    torch.testing.assert_close(accumulated.state_dict(), large.state_dict(), atol=1e-6, rtol=0)


def test_gradient_clipping_matches_clip_grad_norm(make_net, classification):
    x, y = classification
    expected = hand_trained(make_net(), x, y, 2, 8, [torch.arange(len(x))] * 2, clip=0.05, lr=1.0)
    net = make_net()
    easyfit.Model(net, "cross_entropy", "sgd", lr=1.0).fit(x, y, epochs=2, batch_size=8, shuffle=False,
                                                            gradient_clip_val=0.05, verbose=0)
    torch.testing.assert_close(net.state_dict(), expected.state_dict(), atol=1e-6, rtol=0)
    unclipped = easyfit_trained(make_net(), x, y, epochs=2, batch_size=8, shuffle=False)
    assert not torch.allclose(unclipped[0].weight, net[0].weight, atol=1e-3)


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_optimizer_by_name_with_default_and_given_lr(name, make_net, classification):
    cls, default_lr = OPTIMIZERS[name]
    model = easyfit.Model(make_net(), "cross_entropy", name)
    assert type(model.optimizer) is cls and model.optimizer.param_groups[0]["lr"] == default_lr
    net = make_net()
    before = copy.deepcopy(net.state_dict())
    model = easyfit.Model(net, "cross_entropy", name.upper(), lr=0.003)
    assert model.optimizer.param_groups[0]["lr"] == 0.003
    model.fit(*classification, epochs=1, verbose=0)
    assert not torch.equal(net[0].weight, before["0.weight"])
    assert model.optimizer.param_groups[0]["lr"] == 0.003   # fit leaves the user's LR as it was


def test_optimizer_instance_and_factory(make_net, classification):
    net = make_net()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    assert easyfit.Model(net, optimizer=optimizer).optimizer is optimizer
    calls = []

    def factory(params):
        calls.append(1)
        return torch.optim.RMSprop(params, lr=0.02)
    model = easyfit.Model(make_net(), optimizer=factory)
    assert calls == [1] and isinstance(model.optimizer, torch.optim.RMSprop)
    model.fit(*classification, epochs=1, verbose=0)
    assert model.optimizer.state   # the factory's optimizer is the one that stepped


@pytest.mark.parametrize("interval", ["epoch", "step"])
@pytest.mark.parametrize("as_factory", [False, True])
def test_scheduler_instance_or_factory_per_epoch_or_step(interval, as_factory, make_net, classification):
    net = make_net()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)

    def factory(opt):
        return torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    scheduler = factory if as_factory else factory(optimizer)
    rates = LearningRates()
    model = easyfit.Model(net, optimizer=optimizer, scheduler=scheduler, scheduler_interval=interval)
    model.fit(*classification, epochs=3, batch_size=34, callbacks=[rates], verbose=0)   # 3 steps an epoch
    steps = range(9)
    expected = [0.1 * 0.5 ** (step // 3 if interval == "epoch" else step) for step in steps]
    assert rates.values == pytest.approx(expected)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.1 * 0.5 ** (3 if interval == "epoch" else 9))


def test_reduce_lr_on_plateau_steps_on_the_validation_loss(make_net, classification):
    x, y = classification
    net = make_net()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.0)   # no learning: the loss never improves
    scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, patience=0, factor=0.5)
    model = easyfit.Model(net, optimizer=optimizer, scheduler=scheduler)
    model.fit(x, y, epochs=3, validation_split=0.2, verbose=0)
    assert scheduler.best == pytest.approx(model.history.history["val_loss"][0])
