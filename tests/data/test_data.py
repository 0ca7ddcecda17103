"""Every form of data that fit / evaluate / predict accept, through easyfit.Model."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

import easyfit
from easyfit.callbacks import Callback


class PairDataset(Dataset):
    """A map-style dataset returning (x, y) tuples, or {"x": ..., "y": ...} dicts."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor, as_dict: bool = False):
        self.x, self.y, self.as_dict = x, y, as_dict

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i):
        return {"x": self.x[i], "y": self.y[i]} if self.as_dict else (self.x[i], self.y[i])


class BatchSizes(Callback):
    """Records the size of every training and evaluation batch."""

    def __init__(self):
        self.train, self.test = [], []

    def on_train_batch_end(self, batch, logs=None):
        self.train.append(logs["size"])

    def on_test_batch_end(self, batch, logs=None):
        self.test.append(logs["size"])


class TwoInputs(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(4, 3), nn.Linear(2, 3)

    def forward(self, x1, x2):
        return self.a(x1) + self.b(x2)


class OrderRecorder(nn.Module):
    """A linear net that records the sample ids (feature 0) it sees while training."""

    def __init__(self):
        super().__init__()
        self.linear, self.seen = nn.Linear(2, 3), []

    def forward(self, x):
        if self.training:
            self.seen.append(x[:, 0].long())
        return self.linear(x)


def batches(x, y, size=8, as_list=False):
    return [[x[i:i + size], y[i:i + size]] if as_list else (x[i:i + size], y[i:i + size])
            for i in range(0, len(x), size)]


def data_forms(x, y) -> dict:
    """(args, kwargs) for fit / evaluate with the same samples in batches of 8, in order."""
    return {
        "tensors": ((x, y), {}),
        "numpy_float64": ((x.double().numpy(), y.numpy()), {}),
        "tensor_dataset": ((TensorDataset(x, y),), {}),
        "tuple_dataset": ((PairDataset(x, y),), {}),
        "dict_dataset": ((PairDataset(x, y, as_dict=True),), {}),
        "dataloader": ((DataLoader(TensorDataset(x, y), batch_size=8),), {"batch_size": 999}),
        "list_of_tuples": ((batches(x, y),), {}),
        "list_of_lists": ((batches(x, y, as_list=True),), {}),
    }


FORMS = list(data_forms(torch.zeros(1, 1), torch.zeros(1)))


def fitted(net, args, kwargs, shuffle=False) -> easyfit.Model:
    model = easyfit.Model(net, "cross_entropy", "sgd", lr=0.1)
    model.fit(*args, **{"batch_size": 8, "epochs": 2, "shuffle": shuffle, "verbose": 0, **kwargs})
    return model


@pytest.mark.parametrize("form, shuffle", [(form, False) for form in FORMS] + [
    (form, True) for form in ("numpy_float64", "tensor_dataset", "tuple_dataset", "dict_dataset")])
def test_fit_gives_the_same_weights_for_every_data_form(form, shuffle, make_net, classification):
    """Shuffled in-memory data and datasets see the same order: EpochSampler's."""
    x, y = classification
    expected = fitted(make_net(), (x, y), {}, shuffle).net.state_dict()
    args, kwargs = data_forms(x, y)[form]
    model = fitted(make_net(), args, kwargs, shuffle)
    torch.testing.assert_close(model.net.state_dict(), expected, atol=1e-6, rtol=0)
    assert all(p.dtype == torch.float32 for p in model.net.parameters())


@pytest.mark.parametrize("form", FORMS)
def test_evaluate_gives_the_same_scores_for_every_data_form(form, make_net, classification):
    x, y = classification
    model = easyfit.Model(make_net(), "cross_entropy", "sgd", metrics=["accuracy"])
    expected = model.evaluate(x, y, batch_size=8, verbose=0, return_dict=True)
    args, kwargs = data_forms(x, y)[form]
    scores = model.evaluate(*args, **{"batch_size": 8, "verbose": 0, **kwargs}, return_dict=True)
    assert scores.keys() == {"loss", "accuracy"}
    assert scores["loss"] == pytest.approx(expected["loss"], abs=1e-6)
    assert scores["accuracy"] == pytest.approx(expected["accuracy"])


@pytest.mark.parametrize("form", FORMS + ["x_only_tensor_dataset", "list_of_x_batches"])
def test_predict_returns_outputs_in_input_order(form, make_net, classification):
    x, y = classification
    net = make_net()
    extra = {"x_only_tensor_dataset": ((TensorDataset(x),), {}),
             "list_of_x_batches": (([(x[i:i + 8],) for i in range(0, len(x), 8)],), {})}
    args, kwargs = {**data_forms(x, y), **extra}[form]
    predictions = easyfit.Model(net).predict(args[0], **{"batch_size": 8, **kwargs})
    if form == "numpy_float64":   # numpy in, numpy out
        predictions = torch.as_tensor(predictions)
    assert isinstance(predictions, torch.Tensor) and predictions.dtype == torch.float32
    torch.testing.assert_close(predictions, net(x).detach(), atol=1e-6, rtol=0)


class HasModuleAttribute(nn.Module):
    """A user's net that keeps its layer in an attribute named `module`, as DDP wrappers do."""

    def __init__(self):
        super().__init__()
        self.module = nn.Linear(4, 3)

    def forward(self, x):
        return 2 * self.module(x)


def test_a_net_with_a_module_attribute_is_evaluated_and_predicted_as_itself(classification):
    x, y = classification
    net = HasModuleAttribute()
    torch.testing.assert_close(easyfit.Model(net).predict(x), net(x).detach())
    loss = torch.nn.functional.cross_entropy(net(x), y).item()
    assert easyfit.Model(net).evaluate(x, y, verbose=0, return_dict=True)["loss"] == pytest.approx(loss, abs=1e-5)


def test_fit_trains_the_users_net_object(make_net, classification):
    net = make_net()
    initial = copy.deepcopy(net.state_dict())
    model = easyfit.Model(net, "cross_entropy", "adam", lr=0.05)
    model.fit(*classification, epochs=2, verbose=0)
    assert model.net is net
    assert not torch.equal(net[0].weight, initial["0.weight"])


def test_multi_input_net_gets_every_input(classification):
    x1, y = classification
    x2 = torch.randn(len(x1), 2, generator=torch.Generator().manual_seed(2))
    for data in (TensorDataset(x1, x2, y), [(x1[i:i + 8], x2[i:i + 8], y[i:i + 8]) for i in range(0, 101, 8)]):
        net = TwoInputs()
        model = easyfit.Model(net, "cross_entropy", "adam", lr=0.05)
        history = model.fit(data, epochs=3, batch_size=8, verbose=0)
        assert history.history["loss"][-1] < history.history["loss"][0]
        loss = model.evaluate(data, verbose=0)
        assert loss == pytest.approx(history.history["loss"][-1], abs=0.2)
        torch.testing.assert_close(model.predict(TensorDataset(x1, x2, y)), net(x1, x2).detach())


@pytest.mark.parametrize("form", ["pair", "dataset", "dataloader"])
def test_validation_data_forms(form, make_net, classification):
    x, y = classification
    x_val, y_val = x[:30] * 2, y[:30]
    validation_data = {"pair": (x_val, y_val), "dataset": PairDataset(x_val, y_val),
                       "dataloader": DataLoader(TensorDataset(x_val, y_val), batch_size=7)}[form]
    model = easyfit.Model(make_net(), "cross_entropy", "sgd", metrics=["accuracy"])
    history = model.fit(x, y, epochs=2, validation_data=validation_data, verbose=0)
    assert len(history.history["val_loss"]) == 2
    expected = model.evaluate(x_val, y_val, verbose=0, return_dict=True)
    assert history.history["val_loss"][-1] == pytest.approx(expected["loss"], abs=1e-6)
    assert history.history["val_accuracy"][-1] == pytest.approx(expected["accuracy"])


@pytest.mark.parametrize("as_dataset", [False, True])
def test_validation_split_holds_out_the_last_samples_before_shuffling(as_dataset, make_net, classification):
    x, y = classification
    sizes = BatchSizes()
    model = easyfit.Model(make_net(), "cross_entropy", "sgd")
    data = (PairDataset(x, y),) if as_dataset else (x, y)
    history = model.fit(*data, epochs=1, batch_size=8, validation_split=0.2, shuffle=True, callbacks=[sizes],
                        verbose=0)
    assert sum(sizes.train) == 80 and sum(sizes.test) == 21   # Keras: train = floor(101 * 0.8)
    assert history.history["val_loss"][0] == pytest.approx(model.evaluate(x[80:], y[80:], verbose=0),
                                                           abs=1e-6)


def test_shuffle_off_keeps_order_and_on_permutes_each_epoch():
    x = torch.stack([torch.arange(20.0), torch.ones(20)], dim=1)
    y = torch.zeros(20, dtype=torch.long)
    orders = {}
    for shuffle in (False, True):
        net = OrderRecorder()
        easyfit.Model(net, "cross_entropy", "sgd").fit(x, y, epochs=2, batch_size=6, shuffle=shuffle, verbose=0)
        orders[shuffle] = [torch.cat(net.seen[:4]), torch.cat(net.seen[4:])]
    assert all(torch.equal(order, torch.arange(20)) for order in orders[False])
    first, second = orders[True]
    assert torch.equal(first.sort().values, torch.arange(20)) and torch.equal(second.sort().values, torch.arange(20))
    assert not torch.equal(first, torch.arange(20)) and not torch.equal(first, second)


def test_a_generator_trains_one_epoch_and_explains_why_not_two(make_net, classification):
    x, y = classification
    model = easyfit.Model(make_net(), "cross_entropy", "sgd")
    assert len(model.fit(iter(batches(x, y)), epochs=1, verbose=0).history["loss"]) == 1
    with pytest.raises(ValueError, match="exhausted after one pass.*re-iterable"):
        model.fit(iter(batches(x, y)), epochs=2, verbose=0)
