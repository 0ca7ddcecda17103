"""The data a learner has: in-memory dtypes converted as Keras does, and what cannot work explained before training."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import easyfit
from easyfit.callbacks import Callback


class CountSteps(Callback):
    """Counts the training steps that finished (the checks of the first batch run inside its step)."""

    def __init__(self):
        self.steps = 0

    def on_train_batch_end(self, batch, logs=None):
        self.steps += 1


def fit_weights(net: nn.Module, x, y, **kwargs) -> list[torch.Tensor]:
    easyfit.Model(net, kwargs.pop("loss", "cross_entropy"), "sgd").fit(x, y, epochs=2, batch_size=16, verbose=0,
                                                                      shuffle=False, **kwargs)
    return [p.detach().clone() for p in net.parameters()]


def assert_same(first: list[torch.Tensor], second: list[torch.Tensor]) -> None:
    assert all(torch.equal(a, b) for a, b in zip(first, second))


def fit_error_before_training(net, x, y, error_type=ValueError, **kwargs) -> str:
    """The error's message; no training step ran and the weights did not change."""
    before = [p.detach().clone() for p in net.parameters()]
    steps = CountSteps()
    model = easyfit.Model(net, kwargs.pop("loss", "cross_entropy"), "sgd")
    with pytest.raises(error_type) as error:
        model.fit(x, y, epochs=2, batch_size=kwargs.pop("batch_size", 16), verbose=0, callbacks=[steps], **kwargs)
    assert steps.steps == 0
    assert_same(before, [p.detach() for p in net.parameters()])
    return str(error.value)


@pytest.fixture
def digits_like() -> tuple[np.ndarray, np.ndarray]:
    """48 samples of 8x8 uint8 "images" (0-255) and labels 0..2."""
    generator = np.random.default_rng(0)
    return generator.integers(0, 256, size=(48, 64), dtype=np.uint8), generator.integers(0, 3, size=48)


@pytest.mark.parametrize("dtype", ["uint8", "bool", "int64", "float16"])
def test_numpy_inputs_of_other_dtypes_train_as_float32(dtype, make_net, digits_like):
    images, labels = digits_like
    x = (images > 127) if dtype == "bool" else images.astype(dtype)
    converted = fit_weights(make_net(in_features=64), x, labels)
    assert_same(converted, fit_weights(make_net(in_features=64), x.astype(np.float32), labels))


def test_float64_tensors_train_as_the_nets_float32(make_net, regression):
    x, y = regression
    converted = fit_weights(make_net(out_features=1), x.double(), y.double(), loss="mse")
    assert_same(converted, fit_weights(make_net(out_features=1), x, y, loss="mse"))


def test_integer_inputs_to_an_embedding_stay_integers():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Embedding(10, 4), nn.Flatten(), nn.Linear(12, 2))
    tokens, labels = torch.randint(0, 10, (32, 3)), torch.randint(0, 2, (32,))
    easyfit.Model(net, optimizer="sgd").fit(tokens.numpy(), labels.numpy(), verbose=0)
    assert easyfit.Model(net).predict(tokens).shape == (32, 2)


def test_a_net_of_integer_inputs_that_fails_for_another_reason_reports_that_reason():
    """The retry with the integers as floats fails too (an Embedding takes no floats): the error shown is the first
    one, not the Embedding's complaint about the floats easyfit tried."""
    net = nn.Sequential(nn.Embedding(10, 4), nn.Flatten(), nn.Linear(5, 2))   # 12 features reach a Linear of 5
    tokens, labels = torch.randint(0, 10, (32, 3)), torch.randint(0, 2, (32,))
    with pytest.raises((RuntimeError, TypeError, ValueError)) as caught:
        easyfit.Model(net, optimizer="sgd").fit(tokens, labels, verbose=0)
    assert "12" in str(caught.value) and "indices" not in str(caught.value), str(caught.value)


def test_pandas_dataframe_and_series(make_net):
    pandas = pytest.importorskip("pandas")
    generator = np.random.default_rng(0)
    values = generator.normal(size=(40, 4))
    frame = pandas.DataFrame(values, columns=list("abcd")).assign(d=values[:, 3] > 0)   # a bool column
    labels = pandas.Series(generator.integers(0, 3, size=40))
    converted = fit_weights(make_net(), frame, labels)
    expected = np.column_stack([values[:, :3], values[:, 3] > 0]).astype(np.float32)
    assert_same(converted, fit_weights(make_net(), expected, labels.to_numpy()))
    message = fit_error_before_training(make_net(), frame.assign(city="Oslo"), labels, TypeError)
    assert "DataFrame" in message and "'city' (" in message and "get_dummies" in message


def test_labels_of_shape_n_by_1_are_squeezed_for_cross_entropy(make_net, classification):
    x, y = classification
    assert_same(fit_weights(make_net(), x, y[:, None]), fit_weights(make_net(), x, y))


def test_labels_of_shape_n_by_1_in_a_dataloader_are_explained(make_net, classification):
    x, y = classification
    message = fit_error_before_training(make_net(), DataLoader(TensorDataset(x, y[:, None]), batch_size=16), None)
    assert "shape (16, 1)" in message and "class indices of shape (16,)" in message and "y.view(-1)" in message


@pytest.mark.parametrize("bad", [3, -1])
def test_labels_out_of_range_name_the_range(bad, make_net, classification):
    x, y = classification
    y = y.clone()
    y[-1] = bad   # in the last batch: every in-memory label is checked, not only the first batch's
    message = fit_error_before_training(make_net(), x, y)
    assert f"class index {bad}" in message and "3 outputs" in message and "[0, 2]" in message


def test_ignore_index_labels_are_not_out_of_range(make_net, classification):
    x, y = classification
    y = y.clone()
    y[::7] = -100   # CrossEntropyLoss's default ignore_index
    fit_weights(make_net(), x, y)


def test_wrong_input_width_names_both_widths(make_net, classification):
    x, y = classification
    message = fit_error_before_training(make_net(), torch.cat([x, x[:, :1]], dim=1), y)
    assert "layer '0' (Linear) expects 4 features per sample, but the data has 5" in message
    assert "float32 tensor of shape (16, 5)" in message


def test_images_into_a_linear_layer_suggest_flatten():
    net = nn.Sequential(nn.Linear(64, 3))
    message = fit_error_before_training(net, torch.rand(20, 1, 8, 8), torch.randint(0, 3, (20,)))
    assert "expects 64 features per sample, but the data has 8" in message and "nn.Flatten()" in message


def test_channels_last_images_into_a_convolution():
    net = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten(), nn.Linear(4 * 6 * 6, 2))
    message = fit_error_before_training(net, torch.rand(20, 8, 8, 3), torch.randint(0, 2, (20,)))
    assert "layer '0' (Conv2d) expects 3 channels, but the data has 8" in message and "permute(0, 3, 1, 2)" in message


def test_wrong_validation_width_is_reported_before_the_first_epoch(make_net, classification):
    x, y = classification
    message = fit_error_before_training(make_net(), x, y, validation_data=(x[:, :3], y))
    assert message.startswith("the validation data does not fit the net") and "the data has 3" in message


def test_uint8_batches_from_a_dataloader_are_explained(make_net, digits_like):
    images, labels = (torch.as_tensor(a) for a in digits_like)
    loader = DataLoader(TensorDataset(images, labels), batch_size=16)
    message = fit_error_before_training(make_net(in_features=64), loader, None, TypeError)
    assert "uint8 tensor of shape (16, 64)" in message and "float32" in message and "x.float() / 255" in message
    message = fit_error_before_training(make_net(in_features=64), images.float(), labels, TypeError,
                                        validation_data=loader)
    assert message.startswith("the net cannot run on the validation data")


@pytest.mark.parametrize("loss", [nn.MSELoss(reduction="none"), lambda output, target: (output - target) ** 2])
def test_a_loss_that_returns_no_scalar(loss, make_net, regression):
    message = fit_error_before_training(make_net(out_features=1), *regression, loss=loss)
    assert "one number (a scalar tensor)" in message and "shape (16, 1)" in message and "mean" in message


def test_bce_on_logits_suggests_bce_with_logits(make_net, classification):
    x, y = classification
    message = fit_error_before_training(make_net(out_features=1), x, (y[:, None] > 0).float(), loss="bce")
    assert "probabilities in [0, 1]" in message and "'bce_with_logits'" in message


def test_a_batch_of_one_into_batchnorm_is_reported_with_fixes(classification):
    x, y = classification   # 101 samples: batches of 50 leave one
    net = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 3))
    message = fit_error_before_training(net, x, y, batch_size=50)
    assert "a batch of 1 sample (101 samples in batches of 50)" in message and "BatchNorm1d '1'" in message
    assert "e.g. 51" in message and "drop_last=True" in message
    assert "batch_size=2 or more" in fit_error_before_training(net, x, y, batch_size=1)
    fit_weights(net, DataLoader(TensorDataset(x, y), batch_size=50, drop_last=True), None)   # the offered fix


def test_a_batch_of_one_image_into_batchnorm2d_is_fine():
    net = nn.Sequential(nn.Conv2d(1, 2, 3), nn.BatchNorm2d(2), nn.Flatten(), nn.Linear(8, 2))
    images, labels = torch.rand(17, 1, 4, 4), torch.randint(0, 2, (17,))
    easyfit.Model(net, optimizer="sgd").fit(images, labels, batch_size=16, verbose=0)


def test_a_one_shot_generator_as_validation_data_is_named_as_such(make_net, classification):
    x, y = classification
    batches = ((x[i:i + 32], y[i:i + 32]) for i in range(0, len(x), 32))
    model = easyfit.Model(make_net(), optimizer="sgd")
    with pytest.raises(ValueError, match="the validation data yielded no batches in epoch 2: a one-shot"):
        model.fit(x, y, epochs=2, verbose=0, validation_data=batches)


def test_the_check_changes_no_state(classification):
    """The first-batch run is in eval mode without gradients on a copy of the RNG state: dropout and
    BatchNorm's running statistics train exactly as in a loop written by hand."""
    x, y = classification

    def net() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Dropout(0.5), nn.Linear(8, 3))

    torch.manual_seed(1)
    trained = net()
    easyfit.Model(trained, optimizer="sgd").fit(x, y, batch_size=30, shuffle=False, verbose=0)
    torch.manual_seed(1)
    reference = net()
    optimizer = torch.optim.SGD(reference.parameters(), lr=1e-2)
    for i in range(0, len(x), 30):
        optimizer.zero_grad()
        nn.functional.cross_entropy(reference(x[i:i + 30]), y[i:i + 30]).backward()
        optimizer.step()
    assert_same(list(trained.state_dict().values()), list(reference.state_dict().values()))
