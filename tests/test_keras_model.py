"""The Model conveniences a Keras user types: evaluate's list, predict's return kind, eval mode after fit,
weights as numpy arrays, weight files, and the single-batch calls."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from sklearn.datasets import load_breast_cancer, load_digits
from sklearn.metrics import accuracy_score
from torch import nn

import easyfit


@pytest.fixture(scope="module")
def digits() -> tuple[np.ndarray, np.ndarray]:
    x, y = load_digits(return_X_y=True)
    return (x / 16.0).astype(np.float32), y.astype(np.int64)


def digits_net(seed: int = 0, dropout: float = 0.0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Dropout(dropout), nn.Linear(32, 10))


def test_evaluate_returns_loss_then_metrics_in_the_given_order_and_a_dict_on_request(digits):
    x, y = digits
    model = easyfit.Model(digits_net(), "cross_entropy", "adam", metrics=["accuracy", "f1"])
    model.fit(x, y, epochs=2, verbose=0)
    loss, accuracy, f1 = model.evaluate(x, y, verbose=0)
    expected_accuracy = accuracy_score(y, model.predict(x).argmax(axis=1))
    assert accuracy == pytest.approx(expected_accuracy, abs=1e-6)
    assert loss == pytest.approx(nn.functional.cross_entropy(model.net(torch.as_tensor(x)), torch.as_tensor(y))
                                 .item(), abs=1e-5)
    assert model.evaluate(x, y, verbose=0, return_dict=True) == pytest.approx(
        {"loss": loss, "accuracy": accuracy, "f1": f1})
    reordered = easyfit.Model(model.net, "cross_entropy", metrics=["f1", "accuracy"])
    assert reordered.evaluate(x, y, verbose=0) == pytest.approx([loss, f1, accuracy])


def test_evaluate_without_metrics_returns_the_loss_alone(digits):
    x, y = digits
    loss = easyfit.Model(digits_net(), "cross_entropy").evaluate(x, y, verbose=0)
    assert isinstance(loss, float)


def test_predict_returns_numpy_for_numpy_input_and_a_tensor_for_a_tensor(digits):
    x, _ = digits
    model = easyfit.Model(digits_net())
    from_numpy = model.predict(x)
    assert isinstance(from_numpy, np.ndarray) and from_numpy.shape == (len(x), 10)
    from_tensor = model.predict(torch.as_tensor(x))
    assert isinstance(from_tensor, torch.Tensor)
    np.testing.assert_allclose(from_numpy, from_tensor.numpy())
    assert isinstance(model.predict_on_batch(x[:5]), np.ndarray)


def test_predict_under_mixed_precision_returns_float32(digits):
    x, _ = digits
    model = easyfit.Model(digits_net())
    outputs = model.predict(torch.as_tensor(x[:40]), precision="bf16-mixed")
    assert outputs.dtype == torch.float32
    assert model.predict(x[:40]).dtype == np.float32


def test_after_fit_the_net_runs_inference_as_predict_does(digits):
    x, y = digits
    net = digits_net(dropout=0.5)
    model = easyfit.Model(net, "cross_entropy", "adam")
    model.fit(x, y, epochs=1, verbose=0)
    assert not net.training
    with torch.no_grad():
        direct = net(torch.as_tensor(x)).numpy()
    # one batch of 1,797 against batches of 32: kernels of other sizes may round differently
    np.testing.assert_allclose(direct, model.predict(x), atol=1e-6, rtol=0)


def test_get_and_set_weights_round_trip_every_parameter_and_buffer(digits):
    x, y = digits
    net = nn.Sequential(nn.Linear(64, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 10))
    model = easyfit.Model(net, "cross_entropy", "adam")
    model.fit(x, y, epochs=1, verbose=0)
    weights = model.get_weights()
    assert [w.shape for w in weights] == [tuple(v.shape) for v in net.state_dict().values()]
    assert all(isinstance(w, np.ndarray) for w in weights)
    weights[0][:] = 0.0   # a copy: changing it leaves the net alone
    assert net[0].weight.abs().sum() > 0
    other = easyfit.Model(nn.Sequential(nn.Linear(64, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 10)))
    other.set_weights(model.get_weights())
    np.testing.assert_array_equal(other.predict(x), model.predict(x))
    assert model.count_params() == sum(p.numel() for p in net.parameters()) == 64 * 16 + 16 + 32 + 16 * 10 + 10


def test_set_weights_names_the_entry_whose_shape_is_wrong():
    model = easyfit.Model(nn.Linear(3, 2))
    with pytest.raises(ValueError, match=r"'weight' expected shape \(2, 3\), received \(3, 2\)"):
        model.set_weights([np.zeros((3, 2)), np.zeros(2)])
    with pytest.raises(ValueError, match="expected a list of 2 arrays"):
        model.set_weights([np.zeros((2, 3))])


def test_save_weights_writes_a_file_a_plain_net_loads(tmp_path, digits):
    x, y = digits
    model = easyfit.Model(digits_net(), "cross_entropy", "adam")
    model.fit(x, y, epochs=1, verbose=0)
    model.save_weights(tmp_path / "w.pt")
    plain = digits_net(seed=1)
    plain.load_state_dict(torch.load(tmp_path / "w.pt"))
    plain.eval()
    np.testing.assert_allclose(plain(torch.as_tensor(x)).detach().numpy(), model.predict(x), atol=1e-6, rtol=0)
    fresh = easyfit.Model(digits_net(seed=2))
    fresh.load_weights(tmp_path / "w.pt")
    np.testing.assert_array_equal(fresh.predict(x), model.predict(x))
    model.save(tmp_path / "full.pt")   # a full checkpoint's weights load too
    from_checkpoint = easyfit.Model(digits_net(seed=3))
    from_checkpoint.load_weights(tmp_path / "full.pt")
    np.testing.assert_array_equal(from_checkpoint.predict(x), model.predict(x))


def test_train_on_batch_takes_one_step_on_that_batch_as_plain_pytorch():
    x, y = load_breast_cancer(return_X_y=True)
    x = ((x - x.mean(0)) / x.std(0)).astype(np.float32)[:64]
    y = y.astype(np.float32)[:64, None]
    torch.manual_seed(0)
    net = nn.Linear(30, 1)
    reference = nn.Linear(30, 1)
    reference.load_state_dict(net.state_dict())
    model = easyfit.Model(net, "bce_with_logits", "sgd", metrics=["accuracy"], lr=0.1)
    history = model.history
    loss, accuracy = model.train_on_batch(x, y)
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    expected = nn.functional.binary_cross_entropy_with_logits(reference(torch.as_tensor(x)), torch.as_tensor(y))
    expected.backward()
    optimizer.step()
    assert loss == pytest.approx(expected.item(), abs=1e-6)
    torch.testing.assert_close(net.state_dict(), reference.state_dict())
    assert model.history is history and model.completed_epochs == 0
    assert 0.0 <= accuracy <= 1.0
    assert model.test_on_batch(x, y, return_dict=True) == pytest.approx(model.evaluate(x, y, verbose=0,
                                                                                        return_dict=True))
