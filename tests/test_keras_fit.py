"""fit's Keras options: sample_weight, class_weight, weighted validation data, steps_per_epoch, validation_steps,
epochs=0. Weighted losses are compared with a plain PyTorch loop on real data."""
from __future__ import annotations

import functools
import itertools
import warnings

import numpy as np
import pytest
import torch
from sklearn.datasets import load_breast_cancer, load_digits
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

import easyfit
from easyfit.callbacks import Callback


@pytest.fixture(scope="module")
def cancer() -> tuple[torch.Tensor, torch.Tensor]:
    x, y = load_breast_cancer(return_X_y=True)
    x = (x - x.mean(0)) / x.std(0)
    return torch.as_tensor(x, dtype=torch.float32), torch.as_tensor(y, dtype=torch.float32)[:, None]


@pytest.fixture(scope="module")
def digits() -> tuple[torch.Tensor, torch.Tensor]:
    x, y = load_digits(return_X_y=True)
    return torch.as_tensor(x / 16.0, dtype=torch.float32), torch.as_tensor(y)


def linear(inputs: int, outputs: int, seed: int = 0) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(inputs, outputs)


def hand_trained(net: nn.Module, x, y, weights, per_sample, epochs: int, batch_size: int, lr: float):
    """Plain PyTorch: SGD on sum(w_i * loss_i) / batch size, batches in order; the epochs' mean losses."""
    optimizer = torch.optim.SGD(net.parameters(), lr=lr)
    means = []
    for _ in range(epochs):
        total = 0.0
        for start in range(0, len(x), batch_size):
            end = start + batch_size
            loss = (per_sample(net(x[start:end]), y[start:end]) * weights[start:end]).sum() / len(x[start:end])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            total += loss.item() * len(x[start:end])
        means.append(total / len(x))
    return means


def test_sample_weight_trains_as_plain_pytorch_on_the_weighted_loss(cancer):
    x, y = cancer
    weights = torch.linspace(0.2, 3.0, len(x))
    net, reference = linear(30, 1), linear(30, 1)
    model = easyfit.Model(net, "bce_with_logits", "sgd", lr=0.05)
    history = model.fit(x, y, sample_weight=weights.numpy(), epochs=2, batch_size=32, shuffle=False, verbose=0)
    expected = hand_trained(reference, x, y, weights, lambda out, target: F.binary_cross_entropy_with_logits(
        out, target, reduction="none").squeeze(1), epochs=2, batch_size=32, lr=0.05)
    torch.testing.assert_close(net.state_dict(), reference.state_dict())
    assert history.history["loss"] == pytest.approx(expected, rel=1e-5)


def test_class_weight_weighs_each_sample_by_its_class_as_plain_pytorch(digits):
    x, y = digits
    class_weight = {0: 2.0, 3: 0.5, 7: 4.0}   # the other classes weigh 1
    table = torch.tensor([class_weight.get(c, 1.0) for c in range(10)])
    net, reference = linear(64, 10), linear(64, 10)
    model = easyfit.Model(net, "cross_entropy", "sgd", lr=0.1)
    history = model.fit(x, y, class_weight=class_weight, epochs=2, batch_size=64, shuffle=False, verbose=0)
    expected = hand_trained(reference, x, y, table[y], functools.partial(F.cross_entropy, reduction="none"),
                            epochs=2, batch_size=64, lr=0.1)
    torch.testing.assert_close(net.state_dict(), reference.state_dict())
    assert history.history["loss"] == pytest.approx(expected, rel=1e-5)


def test_class_weight_reads_one_hot_targets_by_their_argmax(digits):
    x, y = digits
    one_hot = F.one_hot(y, 10).float()
    by_label, by_one_hot = linear(64, 10), linear(64, 10)
    easyfit.Model(by_label, "cross_entropy", "sgd").fit(x, y, class_weight={1: 3.0}, epochs=1, verbose=0)
    easyfit.Model(by_one_hot, "cross_entropy", "sgd").fit(x, one_hot, class_weight={1: 3.0}, epochs=1, verbose=0)
    torch.testing.assert_close(by_label.state_dict(), by_one_hot.state_dict())


def test_unit_weights_train_exactly_as_no_weights(cancer):
    x, y = cancer
    weighted, plain = linear(30, 1), linear(30, 1)
    easyfit.Model(weighted, "bce_with_logits", "sgd").fit(x, y, sample_weight=np.ones(len(x)), epochs=2, verbose=0)
    easyfit.Model(plain, "bce_with_logits", "sgd").fit(x, y, epochs=2, verbose=0)
    torch.testing.assert_close(weighted.state_dict(), plain.state_dict())


def test_weighted_validation_data_gives_the_weighted_mean_loss(digits):
    x, y = digits
    x_val, y_val, w_val = x[:300], y[:300], torch.rand(300, generator=torch.Generator().manual_seed(0))
    net = linear(64, 10)
    model = easyfit.Model(net, "cross_entropy", "sgd", metrics=["accuracy"])
    history = model.fit(x[300:], y[300:], validation_data=(x_val, y_val, w_val), epochs=1, verbose=0)
    with torch.no_grad():
        expected = (F.cross_entropy(net(x_val), y_val, reduction="none") * w_val).sum() / len(x_val)
    assert history.history["val_loss"][0] == pytest.approx(expected.item(), rel=1e-5)
    assert model.evaluate(x_val, y_val, verbose=0)[0] != pytest.approx(expected.item(), rel=1e-3)


def test_validation_split_holds_out_the_weights_of_the_held_out_samples(cancer):
    x, y = cancer
    weights = torch.linspace(0.0, 2.0, len(x))
    net = linear(30, 1)
    history = easyfit.Model(net, "bce_with_logits", "sgd").fit(x, y, sample_weight=weights, validation_split=0.25,
                                                               epochs=1, verbose=0)
    held_out = len(x) - int(len(x) * 0.75)
    with torch.no_grad():
        losses = F.binary_cross_entropy_with_logits(net(x[-held_out:]), y[-held_out:], reduction="none").squeeze(1)
    assert history.history["val_loss"][0] == pytest.approx((losses * weights[-held_out:]).mean().item(), rel=1e-5)


def test_a_callable_loss_weighs_per_sample_values_and_a_scalar_one_is_refused(cancer):
    x, y = cancer
    with_reduction, per_sample, reference = linear(30, 1), linear(30, 1), linear(30, 1)
    weights = torch.linspace(0.5, 1.5, len(x))
    easyfit.Model(with_reduction, F.binary_cross_entropy_with_logits, "sgd").fit(
        x, y, sample_weight=weights, epochs=1, verbose=0, shuffle=False)

    def bce_per_sample(output, target):
        return F.binary_cross_entropy_with_logits(output, target, reduction="none")

    easyfit.Model(per_sample, bce_per_sample, "sgd").fit(x, y, sample_weight=weights, epochs=1, verbose=0,
                                                          shuffle=False)
    easyfit.Model(reference, "bce_with_logits", "sgd").fit(x, y, sample_weight=weights, epochs=1, verbose=0,
                                                           shuffle=False)
    torch.testing.assert_close(with_reduction.state_dict(), reference.state_dict())
    torch.testing.assert_close(per_sample.state_dict(), reference.state_dict())

    def mean_only(output, target):
        return bce_per_sample(output, target).mean()
    with pytest.raises(ValueError, match="need one loss value per sample, but the loss returned a scalar"):
        easyfit.Model(linear(30, 1), mean_only, "sgd").fit(x, y, sample_weight=weights, verbose=0)


def test_weight_arguments_are_checked_before_training(cancer):
    x, y = cancer
    model = easyfit.Model(linear(30, 1), "bce_with_logits", "sgd")
    before = {k: v.clone() for k, v in model.net.state_dict().items()}
    with pytest.raises(ValueError, match="not both"):
        model.fit(x, y, sample_weight=np.ones(len(x)), class_weight={0: 1.0}, verbose=0)
    with pytest.raises(ValueError, match=f"sample_weight has 3 entries but there are {len(x)} training samples"):
        model.fit(x, y, sample_weight=[1.0, 2.0, 3.0], verbose=0)
    with pytest.raises(ValueError, match="needs the data as arrays or tensors"):
        model.fit(DataLoader(TensorDataset(x, y), batch_size=8), class_weight={1: 2.0}, verbose=0)
    with pytest.raises(ValueError, match="class_weight keys must be integer class indices"):
        model.fit(x, y, class_weight={"1": 2.0}, verbose=0)
    torch.testing.assert_close(model.net.state_dict(), before)


def test_an_unweighted_fit_builds_nothing_for_weights(cancer, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("weights machinery used without weights")
    monkeypatch.setattr("easyfit.training.on_rank.weigh_batches", refuse)
    x, y = cancer
    easyfit.Model(linear(30, 1), "bce_with_logits", "sgd").fit(x, y, validation_data=(x, y), verbose=0)


class BatchCounts(Callback):
    def __init__(self):
        self.train: list[int] = []
        self.test: list[int] = []

    def on_epoch_begin(self, epoch, logs=None):
        self.train.append(0)

    def on_train_batch_end(self, batch, logs=None):
        self.train[-1] += 1

    def on_test_begin(self, logs=None):
        self.test.append(0)

    def on_test_batch_end(self, batch, logs=None):
        self.test[-1] += 1


def test_steps_per_epoch_takes_batches_from_an_endless_generator_in_order(cancer):
    x, y = cancer
    served = []

    def endless():
        for index in itertools.count():
            start = (index * 16) % (len(x) - 16)
            served.append(start)
            yield x[start:start + 16], y[start:start + 16]

    counts = BatchCounts()
    net, reference = linear(30, 1), linear(30, 1)
    history = easyfit.Model(net, "bce_with_logits", "sgd").fit(endless(), steps_per_epoch=5, epochs=3,
                                                               callbacks=[counts], verbose=0)
    assert counts.train == [5, 5, 5] and len(history.epoch) == 3 and history.params["steps_per_epoch"] == 5
    optimizer = torch.optim.SGD(reference.parameters(), lr=1e-2)
    for start in served[:15]:
        optimizer.zero_grad()
        F.binary_cross_entropy_with_logits(reference(x[start:start + 16]), y[start:start + 16]).backward()
        optimizer.step()
    torch.testing.assert_close(net.state_dict(), reference.state_dict())


def test_steps_per_epoch_continues_a_pass_and_ends_an_epoch_early_when_it_runs_out_as_keras(cancer):
    x, y = cancer
    counts = BatchCounts()
    with pytest.warns(RuntimeWarning, match="ran out after 1 of this epoch's 3 steps"):
        easyfit.Model(linear(30, 1), "bce_with_logits", "sgd").fit(
            x[:40], y[:40], batch_size=10, steps_per_epoch=3, epochs=4, callbacks=[counts], verbose=0)
    assert counts.train == [3, 1, 3, 1]   # 4 batches per pass: 3, then the pass's last one, then a new pass


class Stream(torch.utils.data.IterableDataset):
    """The samples of (x, y) in order, with no length."""

    def __init__(self, x, y):
        self.x, self.y = x, y

    def __iter__(self):
        return zip(self.x, self.y)


@pytest.mark.parametrize("form", ["tensors", "stream"])
def test_an_epoch_that_runs_out_of_data_steps_its_short_accumulation_window_as_plain_pytorch(cancer, form):
    """10 samples in batches of 2, steps_per_epoch=3, gradient_accumulation_steps=3: epoch 2 trains the pass's last 2
    batches, a short window divided by 3 that is an optimizer step, as a hand-written loop; with tensors (a known
    length) EMA averages it too."""
    x, y = cancer[0][:10], cancer[1][:10]
    net, reference = linear(30, 1), linear(30, 1)
    data = (x, y) if form == "tensors" else (DataLoader(Stream(x, y), batch_size=2),)
    with pytest.warns(RuntimeWarning, match="ran out after 2 of this epoch's 3 steps"):
        easyfit.Model(net, "bce_with_logits", torch.optim.SGD(net.parameters(), lr=0.5)).fit(
            *data, batch_size=2, steps_per_epoch=3, gradient_accumulation_steps=3, epochs=3, shuffle=False,
            lr_scaling=None, callbacks=[easyfit.callbacks.EMA(0.5)] if form == "tensors" else [], verbose=0)
    optimizer, averaged = torch.optim.SGD(reference.parameters(), lr=0.5), None
    for window in ([0, 1, 2], [3, 4], [0, 1, 2]):
        optimizer.zero_grad()
        for batch in window:
            (F.binary_cross_entropy_with_logits(reference(x[2 * batch:2 * batch + 2]), y[2 * batch:2 * batch + 2])
             / 3).backward()
        optimizer.step()
        current = {key: value.detach().clone() for key, value in reference.state_dict().items()}
        averaged = current if averaged is None else {key: (averaged[key] + current[key]) / 2 for key in current}
    torch.testing.assert_close(net.state_dict(), averaged if form == "tensors" else current, atol=1e-6, rtol=0)


def test_validation_steps_limits_each_validation(cancer):
    x, y = cancer
    counts = BatchCounts()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        easyfit.Model(linear(30, 1), "bce_with_logits", "sgd").fit(
            x[:40], y[:40], batch_size=10, validation_data=(x[:80], y[:80]), validation_steps=4, epochs=2,
            callbacks=[counts], verbose=0)
    assert counts.test == [4, 4]


def test_epochs_0_trains_nothing_and_returns_an_empty_history(cancer):
    x, y = cancer
    net = linear(30, 1)
    before = {k: v.clone() for k, v in net.state_dict().items()}
    history = easyfit.Model(net, "bce_with_logits", "sgd").fit(x, y, epochs=0, verbose=0)
    assert history.history == {} and history.epoch == []
    torch.testing.assert_close(net.state_dict(), before)
    with pytest.raises(ValueError, match="epochs must be a non-negative integer, got -1"):
        easyfit.Model(net).fit(x, y, epochs=-1)
    with pytest.raises(ValueError, match="steps_per_epoch must be a positive integer or None, got 0"):
        easyfit.Model(net).fit(x, y, steps_per_epoch=0)
