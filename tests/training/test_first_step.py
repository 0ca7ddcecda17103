"""The first batch is the loop's own first step: it comes from the user's sampler, calls user code no extra time,
and what cannot work is explained before the first optimizer step."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, Sampler, TensorDataset

import easyfit
from easyfit.callbacks import Callback, ModelCheckpoint


class OddIndices(Sampler):
    """Yields only the odd indices of the dataset."""

    def __init__(self, length: int):
        self.length = length

    def __iter__(self):
        return iter(range(1, self.length, 2))

    def __len__(self) -> int:
        return self.length // 2


class Counting(nn.Module):
    """A loss (cross entropy) that counts its calls and records the sample ids it sees (ids ride in the target)."""

    def __init__(self):
        super().__init__()
        self.calls, self.seen = 0, []

    def forward(self, output, target):
        self.calls += 1
        self.seen += (target // 10).tolist()
        return F.cross_entropy(output, target % 10)


class CountingNet(nn.Sequential):
    def __init__(self):
        torch.manual_seed(0)
        super().__init__(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return super().forward(x)


class Steps(Callback):
    def __init__(self):
        self.steps = 0

    def on_train_batch_end(self, batch, logs=None):
        self.steps += 1


def ids_in_targets(classification):
    """Targets that carry each sample's id (id * 10 + class)."""
    x, y = classification
    return x, torch.arange(len(x)) * 10 + y


def test_every_batch_easyfit_looks_at_comes_from_the_loaders_own_sampler(classification):
    x, y = ids_in_targets(classification)
    loss = Counting()
    loader = DataLoader(TensorDataset(x, y), batch_size=8, sampler=OddIndices(len(x)))
    model = easyfit.Model(CountingNet(), loss, "sgd")
    model.fit(loader, epochs=1, verbose=0, validation_data=DataLoader(TensorDataset(x, y), batch_size=8,
                                                                      sampler=OddIndices(len(x))))
    assert loss.seen and all(sample % 2 == 1 for sample in loss.seen)


def test_user_loss_and_forward_are_called_once_per_step(classification):
    x, y = ids_in_targets(classification)
    loss, net, steps = Counting(), CountingNet(), Steps()
    easyfit.Model(net, loss, "sgd").fit(x, y, epochs=2, batch_size=16, verbose=0, callbacks=[steps])
    assert steps.steps == 14 and loss.calls == steps.steps and net.calls == steps.steps
    easyfit.Model(net, loss, "sgd").evaluate(x, y, batch_size=16, verbose=0)
    assert loss.calls == 14 + 7 and net.calls == 14 + 7
    easyfit.Model(net, loss, "sgd").predict(x, batch_size=16)
    assert net.calls == 14 + 7 + 7


@pytest.mark.parametrize("dtype", [np.int32, torch.int32, torch.int16, torch.uint8])
def test_integer_class_labels_of_any_dtype_train_as_int64(dtype, make_net, classification):
    x, y = classification
    labels = y.numpy().astype(dtype) if isinstance(dtype, type) else y.to(dtype)
    expected = make_net()
    easyfit.Model(expected, optimizer="sgd").fit(x, y, epochs=2, batch_size=16, shuffle=False, verbose=0)
    for data in ((x, labels), (DataLoader(TensorDataset(x, torch.as_tensor(labels)), batch_size=16), None)):
        net = make_net()
        model = easyfit.Model(net, optimizer="sgd", metrics=["accuracy"])
        model.fit(*data, epochs=2, batch_size=16, shuffle=False, verbose=0, validation_data=data[0]
                  if data[1] is None else data)
        torch.testing.assert_close(net.state_dict(), expected.state_dict(), rtol=0, atol=0)
        assert model.evaluate(*data, verbose=0, return_dict=True)["accuracy"] >= 0


def error_before_first_step(model, *args, error=ValueError, **kwargs) -> str:
    """fit's error message; no training step finished and the weights are unchanged."""
    before = {k: v.clone() for k, v in model.net.state_dict().items()}
    steps = Steps()
    with pytest.raises(error) as raised:
        model.fit(*args, epochs=2, batch_size=16, verbose=0, callbacks=[steps, *kwargs.pop("callbacks", [])],
                  **kwargs)
    assert steps.steps == 0
    torch.testing.assert_close(model.net.state_dict(), before, rtol=0, atol=0)
    return str(raised.value)


class LSTMNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.lstm = nn.LSTM(4, 8, batch_first=True)

    def forward(self, x):
        return self.lstm(x)


def test_a_tuple_output_with_a_named_loss_or_metric_says_how_to_pick_the_output():
    x, y = torch.randn(32, 5, 4), torch.randint(0, 8, (32,))
    message = error_before_first_step(easyfit.Model(LSTMNet(), "cross_entropy", "sgd"), x, y, error=TypeError)
    assert "returned a tuple of 2 (a tensor of shape (16, 5, 8), a tuple of 2" in message
    assert "CrossEntropyLoss" in message and "net(x)[0]" in message and "loss=lambda output, target" in message
    own_loss = easyfit.Model(LSTMNet(), lambda out, target: F.cross_entropy(out[0][:, -1], target), "sgd",
                             metrics=["accuracy"])
    message = error_before_first_step(own_loss, x, y, error=TypeError)
    assert "the metrics accuracy take one tensor" in message


def test_a_classification_metric_on_regression_targets(make_net, regression):
    model = easyfit.Model(make_net(out_features=1), "mse", "sgd", metrics=["accuracy"])
    message = error_before_first_step(model, *regression)
    assert "'accuracy'" in message and "0/1 labels" in message and "'mae'" in message


def test_top_k_with_fewer_than_k_outputs(make_net, classification):
    model = easyfit.Model(make_net(), "cross_entropy", "sgd", metrics=["top5_accuracy"])
    assert "at least 5 outputs" in error_before_first_step(model, *classification)


def test_a_loss_that_does_not_take_output_and_target_is_refused_at_once():
    with pytest.raises(TypeError, match=r"loss\(output, target\), but <lambda>\(output\) cannot"):
        easyfit.Model(nn.Linear(2, 2), lambda output: output.mean())
    with pytest.raises(TypeError, match=r"cannot take those two arguments"):
        easyfit.Model(nn.Linear(2, 2), lambda output, target, weights: output.mean())


@pytest.mark.parametrize("validation_data", ["x_only", "tuple_of_x", "dataset_without_targets"])
def test_validation_data_without_targets(validation_data, make_net, classification):
    x, y = classification
    data = {"x_only": x[:20], "tuple_of_x": (x[:20],), "dataset_without_targets": TensorDataset(x[:20])}
    model = easyfit.Model(make_net(), "cross_entropy", "sgd")
    message = error_before_first_step(model, x, y, validation_data=data[validation_data])
    assert "validation_data has no targets" in message and "(x_val, y_val)" in message


def test_a_checkpoint_name_with_validation_fields_needs_validation(make_net, classification, tmp_path):
    checkpoint = ModelCheckpoint(str(tmp_path / "best-{epoch:02d}-{val_loss:.3f}.pt"))
    message = error_before_first_step(easyfit.Model(make_net(), "cross_entropy", "sgd"), *classification,
                                      callbacks=[checkpoint])
    assert "val_loss" in message and "validation_data=" in message and "{loss:.3f}" in message


@pytest.mark.parametrize("kind", ["missing", "not_a_checkpoint"])
def test_a_bad_resume_from_is_reported_before_any_forward_pass(kind, classification, tmp_path):
    path = tmp_path / "run.pt"
    if kind == "not_a_checkpoint":
        path.write_text("hello")
    net = CountingNet()
    model = easyfit.Model(net, "cross_entropy", "sgd")
    message = error_before_first_step(model, *classification, resume_from=str(path),
                                      validation_data=classification,
                                      error=FileNotFoundError if kind == "missing" else ValueError)
    assert str(path) in message and net.calls == 0


def test_summary_takes_a_numpy_example():
    net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    text = easyfit.Model(net).summary(print_fn=None, input_example=np.zeros((2, 4)))   # float64, as fit takes
    assert "(2, 8)" in text and "(2, 3)" in text


@pytest.mark.parametrize("lr", [-0.1, float("nan")])
def test_a_negative_learning_rate_by_name(lr):
    with pytest.raises(ValueError, match=r"lr must be a non-negative number \(the learning rate of 'adam'"):
        easyfit.Model(nn.Linear(2, 2), optimizer="adam", lr=lr)
