"""Everyday inputs a Keras user passes: bool labels, a dict of inputs, numpy batches from an iterable, numpy object
arrays, and the fit / Model arguments around them (initial_epoch, lr=0, summary(x))."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import easyfit


def data(samples: int = 64, seed: int = 0):
    generator = np.random.default_rng(seed)
    return generator.normal(size=(samples, 4)).astype("float32"), generator.integers(0, 10, samples)


def trained(loss: str, outputs: int, x, y, **kwargs) -> tuple[dict, list]:
    torch.manual_seed(0)
    model = easyfit.Model(nn.Linear(4, outputs), loss, "sgd", lr=0.1)
    history = model.fit(x, y, epochs=2, batch_size=16, verbose=0, **kwargs)
    return history.history, model.get_weights()


def assert_same(first: tuple[dict, list], second: tuple[dict, list]) -> None:
    assert first[0].keys() == second[0].keys()
    for key in first[0]:
        assert first[0][key] == pytest.approx(second[0][key], abs=1e-6)
    for a, b in zip(first[1], second[1]):
        np.testing.assert_allclose(a, b, atol=1e-6)


# --- bool labels --------------------------------------------------------------------------------------------------
def test_bool_class_labels_train_as_class_indices():
    x, y = data()
    assert_same(trained("cross_entropy", 2, x, y > 4), trained("cross_entropy", 2, x, (y > 4).astype("int64")))


def test_bool_class_labels_from_a_loader_train_as_class_indices():
    x, y = data()
    loader = DataLoader(TensorDataset(torch.from_numpy(x), torch.from_numpy(y > 4)), batch_size=16)
    indices = DataLoader(TensorDataset(torch.from_numpy(x), torch.from_numpy((y > 4).astype("int64"))), batch_size=16)
    assert_same(trained("cross_entropy", 2, loader, None), trained("cross_entropy", 2, indices, None))


@pytest.mark.parametrize("loader", [False, True])
def test_bool_labels_for_bce_with_logits_train_as_floats(loader):
    x, y = data()
    flags, floats = (y > 4)[:, None], (y > 4)[:, None].astype("float32")
    if loader:
        flags = DataLoader(TensorDataset(torch.from_numpy(x), torch.from_numpy(flags)), batch_size=16)
        floats = DataLoader(TensorDataset(torch.from_numpy(x), torch.from_numpy(floats)), batch_size=16)
        assert_same(trained("bce_with_logits", 1, flags, None), trained("bce_with_logits", 1, floats, None))
    else:
        assert_same(trained("bce_with_logits", 1, x, flags), trained("bce_with_logits", 1, x, floats))


# --- a dict of inputs (Keras' multi-input dict) ---------------------------------------------------------------------
class TwoInputs(nn.Module):
    def __init__(self):
        super().__init__()
        self.image, self.meta = nn.Linear(4, 3), nn.Linear(2, 3)

    def forward(self, image, meta):
        return self.image(image) + self.meta(meta)


def two_input_run(x, y, **kwargs):
    torch.manual_seed(0)
    model = easyfit.Model(TwoInputs(), "cross_entropy", "sgd", lr=0.1)
    history = model.fit(x, y, epochs=2, batch_size=16, verbose=0, **kwargs)
    return model, (history.history, model.get_weights())


def test_a_dict_of_inputs_trains_as_the_inputs_by_name():
    x, y = data()
    meta = np.random.default_rng(1).normal(size=(64, 2)).astype("float32")
    by_name, as_dict = two_input_run({"meta": meta, "image": x}, y % 3, validation_split=0.25)
    in_order, as_list = two_input_run([x, meta], y % 3, validation_split=0.25)
    assert "val_loss" in as_dict[0]
    assert_same(as_dict, as_list)
    predicted = by_name.predict({"image": x, "meta": meta})
    assert isinstance(predicted, np.ndarray) and predicted.shape == (64, 3)
    np.testing.assert_allclose(predicted, in_order.predict([x, meta]), atol=1e-6)
    scores = by_name.evaluate({"image": torch.from_numpy(x), "meta": torch.from_numpy(meta)}, y % 3, verbose=0)
    assert scores == pytest.approx(in_order.evaluate([x, meta], y % 3, verbose=0), abs=1e-6)


def test_a_tokenizer_s_batch_encoding_trains_evaluates_and_predicts_as_a_dict():
    """A BatchEncoding (what a tokenizer returns) is a mapping, not a dict: it is read as the dict of its inputs."""
    encoding = pytest.importorskip("transformers").BatchEncoding
    x, y = data()
    meta = np.random.default_rng(1).normal(size=(64, 2)).astype("float32")
    inputs = {"image": torch.from_numpy(x), "meta": torch.from_numpy(meta)}
    mapped, as_mapping = two_input_run(encoding(inputs), y % 3, validation_data=(encoding(inputs), y % 3))
    in_order, as_list = two_input_run([x, meta], y % 3, validation_data=((x, meta), y % 3))
    assert_same(as_mapping, as_list)
    assert mapped.evaluate(encoding(inputs), y % 3, verbose=0) == pytest.approx(
        in_order.evaluate([x, meta], y % 3, verbose=0), abs=1e-6)
    torch.testing.assert_close(mapped.predict(encoding(inputs)), torch.from_numpy(in_order.predict([x, meta])))


def test_a_dict_of_inputs_with_sample_weights_and_validation_data():
    x, y = data()
    meta = np.ones((64, 2), dtype="float32")
    weights = np.linspace(0.5, 1.5, 64)
    _, as_dict = two_input_run({"image": x, "meta": meta}, y % 3, sample_weight=weights,
                               validation_data=({"image": x[:8], "meta": meta[:8]}, y[:8] % 3))
    _, as_list = two_input_run([x, meta], y % 3, sample_weight=weights, validation_data=((x[:8], meta[:8]), y[:8] % 3))
    assert_same(as_dict, as_list)


def test_a_dict_of_one_input_is_that_input():
    x, y = data()
    assert_same(trained("cross_entropy", 10, {"features": x}, y), trained("cross_entropy", 10, x, y))


def test_a_dict_of_inputs_of_different_lengths_names_them():
    x, y = data()
    with pytest.raises(ValueError, match=r"x\['image'\] and x\['meta'\] and y have different numbers of samples"):
        two_input_run({"image": x, "meta": x[:10, :2]}, y % 3)


# --- numpy batches from an iterable ------------------------------------------------------------------------------
def test_numpy_batches_from_any_iterable_become_tensors():
    x, y = data()
    torch.manual_seed(0)
    model = easyfit.Model(nn.Linear(4, 10), "cross_entropy", "sgd", lr=0.1)
    pairs = [(x[i:i + 16].astype("float64"), y[i:i + 16]) for i in range(0, 64, 16)]   # float64, as numpy makes
    history = model.fit(pairs, epochs=2, verbose=0).history
    assert_same((history, model.get_weights()), trained("cross_entropy", 10, x, y, shuffle=False))
    predicted = model.predict(x[i:i + 16] for i in range(0, 64, 16))   # a generator of numpy inputs
    np.testing.assert_allclose(np.asarray(predicted), model.predict(x), atol=1e-6)
    assert model.evaluate(iter(pairs), verbose=0) == pytest.approx(model.evaluate(x, y, verbose=0), abs=1e-6)
    dicts = [{"x": x[i:i + 16], "y": y[i:i + 16]} for i in range(0, 64, 16)]
    assert model.evaluate(dicts, verbose=0) == pytest.approx(model.evaluate(x, y, verbose=0), abs=1e-6)


# --- numpy object arrays -----------------------------------------------------------------------------------------
def test_an_object_array_of_numbers_is_cast():
    x, y = data()
    mixed, numbers = x.astype(object), x.copy()
    mixed[:, 0], numbers[:, 0] = x[:, 0] > 0, x[:, 0] > 0   # DataFrame.values of a bool column beside float ones
    assert_same(trained("cross_entropy", 10, mixed, y.astype(object)), trained("cross_entropy", 10, numbers, y))


def test_an_object_array_with_a_non_number_names_its_row_and_column():
    x, y = data()
    mixed = x.astype(object)
    mixed[5, 2] = "n/a"
    with pytest.raises(TypeError, match=r"x is a numpy object array whose row 5, column 2 holds 'n/a' \(str\)"):
        trained("cross_entropy", 10, mixed, y)


# --- fit and Model arguments ---------------------------------------------------------------------------------------
def test_a_negative_initial_epoch_is_refused_by_name():
    x, y = data()
    with pytest.raises(ValueError, match="initial_epoch must be a non-negative integer .*got -1"):
        trained("cross_entropy", 10, x, y, initial_epoch=-1)


def test_a_learning_rate_of_zero_leaves_the_weights_as_they_are():
    x, y = data()
    model = easyfit.Model(nn.Linear(4, 10), "cross_entropy", "sgd", lr=0.0)
    before = model.get_weights()
    model.fit(x, y, epochs=1, verbose=0)
    for a, b in zip(before, model.get_weights()):
        np.testing.assert_array_equal(a, b)


def test_summary_takes_an_example_first():
    net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    printed = []
    model = easyfit.Model(net)
    text = model.summary(np.zeros((2, 4)))
    assert "(2, 8)" in text and "(2, 3)" in text
    assert model.summary(printed.append, np.zeros((2, 4))) == printed[0] == text
    with pytest.raises(TypeError, match="summary's first argument is print_fn"):
        model.summary(np.zeros((2, 4)), input_example=np.zeros((2, 4)))
