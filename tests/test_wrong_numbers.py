"""Calls that used to give wrong numbers without a word: each now gives the right number or a clear error."""
from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import easyfit


class Masked(nn.Module):
    """forward(x, mask): the mask zeroes features; `mask_default` makes the mask optional."""

    def __init__(self, mask_default: bool = False):
        super().__init__()
        torch.manual_seed(0)
        self.linear = nn.Linear(4, 2)
        if mask_default:
            self.forward = self.forward_optional_mask

    def forward(self, x, mask):
        return self.linear(x * mask)

    def forward_optional_mask(self, x, mask=None):
        return self.linear(x if mask is None else x * mask)


@pytest.fixture
def masked_inputs():
    generator = torch.Generator().manual_seed(0)
    return torch.randn(20, 4, generator=generator), (torch.rand(20, 4, generator=generator) > 0.5).float()


# --- 9. gradient_clip_val ---------------------------------------------------------------
@pytest.mark.parametrize("value", [-1, 0, 0.0, float("nan"), "1", True])
def test_gradient_clip_val_must_be_a_positive_number(value, make_net, classification):
    model = easyfit.Model(make_net(), "cross_entropy", "sgd")
    before = {key: tensor.clone() for key, tensor in model.net.state_dict().items()}
    with pytest.raises(ValueError, match="gradient_clip_val must be a positive number"):
        model.fit(*classification, gradient_clip_val=value, verbose=0)
    torch.testing.assert_close(model.net.state_dict(), before, atol=0, rtol=0)


def test_a_positive_gradient_clip_val_trains(make_net, classification):
    easyfit.Model(make_net(), "cross_entropy", "sgd").fit(*classification, gradient_clip_val=np.float32(0.5),
                                                          verbose=0)


# --- 4. cross_entropy over one column; load without the loss ---------------------------------
@pytest.mark.parametrize("targets", ["float column", "class indices"])
def test_cross_entropy_over_a_single_output_column_is_refused(targets, make_net, regression):
    x, y = regression
    if targets == "class indices":
        y = (y[:, 0] > 0).long()
    model = easyfit.Model(make_net(out_features=1), "cross_entropy", "sgd")
    with pytest.raises(ValueError, match="single output column") as error:
        model.fit(x, y, verbose=0)
    assert "loss='mse'" in str(error.value) and "bce_with_logits" in str(error.value)


def test_load_of_a_model_saved_with_a_loss_object_asks_for_the_loss(make_net, regression, tmp_path):
    model = easyfit.Model(make_net(out_features=1), nn.MSELoss(), "sgd")
    model.fit(*regression, verbose=0)
    model.save(tmp_path / "model.pt")
    with pytest.raises(ValueError, match=r"loss=\.\.\."):
        easyfit.Model.load(tmp_path / "model.pt", make_net(out_features=1))
    loaded = easyfit.Model.load(tmp_path / "model.pt", make_net(out_features=1), loss=nn.MSELoss())
    assert loaded.evaluate(*regression, verbose=0) == pytest.approx(model.evaluate(*regression, verbose=0))


# --- 6. ReduceLROnPlateau with validation_freq ---------------------------------------------
class RecordingPlateau(torch.optim.lr_scheduler.ReduceLROnPlateau):
    def step(self, metrics, *args, **kwargs):
        self.seen = [*getattr(self, "seen", []), float(metrics)]
        super().step(metrics, *args, **kwargs)


@pytest.mark.parametrize("validation", [True, False])
def test_reduce_lr_on_plateau_reads_one_quantity(validation, make_net, classification):
    x, y = classification
    model = easyfit.Model(make_net(), "cross_entropy", "sgd", lr=0.1,
                          scheduler=lambda optimizer: RecordingPlateau(optimizer, patience=0))
    options = {"validation_data": (x[:30], y[:30]), "validation_freq": 2} if validation else {}
    history = model.fit(x, y, epochs=6, verbose=0, **options).history
    assert model.scheduler.seen == (history["val_loss"] if validation else history["loss"])


# --- 7. float64 numpy input under precision "64" -----------------------------------------------
def test_precision_64_keeps_float64_numpy_input():
    x = np.array([[1.0 + 1e-12], [2.0 - 1e-12], [1e-40]])   # none of these is a float32 number
    net = nn.Linear(1, 1, bias=False)
    nn.init.ones_(net.weight)
    model = easyfit.Model(net, "mse", "sgd")
    predictions = model.predict(x, precision="64")   # numpy in, numpy out
    assert predictions.dtype == np.float64
    assert np.array_equal(predictions, x)
    assert model.evaluate(x, x, precision="64", verbose=0, return_dict=True)["loss"] == 0.0
    assert model.predict(x, precision="32").dtype == np.float32


def test_precision_64_fit_on_numpy_matches_plain_float64_pytorch(make_net, regression):
    x, y = (tensor.double().numpy() + 1e-9 for tensor in regression)
    model = easyfit.Model(make_net(out_features=1), "mse", "sgd", lr=0.05)
    reference = make_net(out_features=1).double()
    model.fit(x, y, epochs=1, batch_size=64, shuffle=False, precision="64", lr_scaling=None, verbose=0)
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.05)
    nn.functional.mse_loss(reference(torch.from_numpy(x)), torch.from_numpy(y)).backward()
    optimizer.step()
    torch.testing.assert_close(model.net.state_dict(), reference.state_dict(), atol=0, rtol=0)


# --- 5. predict keeps every input ------------------------------------------------------
def test_predict_on_in_memory_inputs_passes_each_one(masked_inputs):
    x, mask = masked_inputs
    for net in (Masked(), Masked(mask_default=True)):
        expected = net(x, mask).detach()
        model = easyfit.Model(net)
        torch.testing.assert_close(model.predict([x, mask], batch_size=8), expected)
        from_numpy = model.predict((x.numpy(), mask.numpy()), batch_size=8)   # numpy in, numpy out
        torch.testing.assert_close(torch.as_tensor(from_numpy), expected)


def test_predict_on_batches_that_are_the_nets_inputs(masked_inputs):
    x, mask = masked_inputs
    net = Masked()
    expected = net(x, mask).detach()
    model = easyfit.Model(net)
    torch.testing.assert_close(model.predict(TensorDataset(x, mask), batch_size=8), expected)
    torch.testing.assert_close(model.predict(DataLoader(TensorDataset(x, mask), batch_size=8)), expected)
    y = torch.zeros(len(x), dtype=torch.long)
    torch.testing.assert_close(model.predict(TensorDataset(x, mask, y), batch_size=8), expected)


def test_predict_passes_a_whole_batch_the_net_can_take_as_its_inputs(masked_inputs):
    """forward(x, mask=None) on TensorDataset(x, mask): the mask is an input, not a target (there are none in
    predict unless the data names them)."""
    x, mask = masked_inputs
    net = Masked(mask_default=True)
    expected = net(x, mask).detach()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        torch.testing.assert_close(easyfit.Model(net).predict(TensorDataset(x, mask)), expected)
        torch.testing.assert_close(easyfit.Model(net).predict(DataLoader(TensorDataset(x, mask), batch_size=8)),
                                   expected)
    torch.testing.assert_close(easyfit.Model(net).predict([((x, mask),)]), expected)
    named = [{"x": x, "mask": mask, "y": torch.zeros(len(x))}]   # a dict names its target: left out
    torch.testing.assert_close(easyfit.Model(net).predict(named), expected)


def test_predict_refuses_batches_that_cannot_be_the_nets_inputs(masked_inputs, make_net):
    x, mask = masked_inputs
    with pytest.raises(ValueError, match=r"batches of 3 tensors.*forward\(input\)"):
        easyfit.Model(make_net()).predict(TensorDataset(x, mask, mask))


def test_fit_and_evaluate_on_in_memory_inputs(masked_inputs):
    x, mask = masked_inputs
    y = (x[:, 0] > 0).long()
    net = Masked()
    model = easyfit.Model(net, "cross_entropy", "sgd")
    model.fit([x, mask], y, epochs=2, verbose=0)
    expected = nn.functional.cross_entropy(net(x, mask), y).item()
    assert model.evaluate([x, mask], y, verbose=0, return_dict=True)["loss"] == pytest.approx(expected, abs=1e-6)
    with pytest.raises(ValueError, match=r"x\[0\] and x\[1\] and y have different numbers of samples"):
        model.fit([x, mask[:-1]], y, verbose=0)


def test_a_list_of_tensors_is_one_per_input_and_a_list_of_batches_says_how(make_net, classification):
    x = classification[0]
    with pytest.raises(ValueError, match=r"one array per input of the net.*\[\(x_batch,\), \.\.\.\]"):
        easyfit.Model(make_net()).predict([x[:50], x[50:]])
    with pytest.raises(ValueError, match=r"2 inputs per batch.*\[\(x_batch,\), \.\.\.\]"):
        easyfit.Model(make_net()).predict([x[:50], x[50:100]])
