"""Precision settings on the CPU: float32, float64, and mixed bf16 / fp16 with autocast and loss scaling."""
from __future__ import annotations

import pytest
import torch

import easyfit
from easyfit.saving.checkpoint import load_checkpoint_file


def fitted(make_net, data, precision: str, epochs: int = 5) -> easyfit.Model:
    model = easyfit.Model(make_net(), "cross_entropy", "adam", metrics=["accuracy"], lr=0.02)
    model.fit(*data, epochs=epochs, batch_size=16, precision=precision, verbose=0)
    return model


def test_32_is_the_default_and_keeps_float32(make_net, classification):
    default = fitted(make_net, classification, "32")
    assert all(p.dtype == torch.float32 for p in default.net.parameters())
    assert default.predict(classification[0]).dtype == torch.float32


def test_64_makes_the_net_and_inputs_float64(make_net, classification):
    model = fitted(make_net, classification, "64")
    assert all(p.dtype == torch.float64 for p in model.net.parameters())
    assert model.history.history["loss"][-1] < model.history.history["loss"][0]
    x = classification[0]
    predictions = model.predict(x)   # evaluate / predict keep the precision of the last fit
    assert predictions.dtype == torch.float64
    torch.testing.assert_close(predictions, model.net(x.double()).detach())
    batches = model.predict([(x[:50],), (x[50:],)])
    torch.testing.assert_close(batches, predictions)
    assert model.evaluate(*classification, verbose=0, return_dict=True)["loss"] < model.history.history["loss"][0]


def test_switching_precision_between_fits_converts_weights_and_adam_state(make_net, classification):
    model = easyfit.Model(make_net(), "cross_entropy", "adam")
    for precision, dtype in (("32", torch.float32), ("64", torch.float64), ("bf16-mixed", torch.float32)):
        model.fit(*classification, epochs=1, precision=precision, verbose=0)
        assert {p.dtype for p in model.net.parameters()} == {dtype}
        assert {state["exp_avg"].dtype for state in model.optimizer.state.values()} == {dtype}


@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed"])
def test_mixed_precision_trains_on_cpu(precision, make_net, classification, tmp_path):
    model = fitted(make_net, classification, precision)
    losses = model.history.history["loss"]
    assert losses[-1] < losses[0]
    assert all(p.dtype == torch.float32 for p in model.net.parameters())   # master weights stay float32
    assert model.evaluate(*classification, verbose=0, return_dict=True)["loss"] < losses[0]
    model.save(tmp_path / "mixed.pt")   # after an evaluate: the scaler state is still the fit's
    scaler_state = load_checkpoint_file(tmp_path / "mixed.pt")["scaler"]
    if precision == "16-mixed":
        assert scaler_state["scale"] > 0 and scaler_state["_growth_tracker"] == 5 * 7   # 7 steps an epoch
    else:
        assert scaler_state == {}


def test_autocast_runs_the_forward_in_the_low_precision_dtype(make_net, classification):
    dtypes = []
    net = make_net()
    net.register_forward_hook(lambda module, inputs, output: dtypes.append(output.dtype))
    easyfit.Model(net).fit(*classification, epochs=1, precision="bf16-mixed", verbose=0)
    assert set(dtypes) == {torch.bfloat16}


def test_unknown_precision_lists_the_valid_values(make_net, classification):
    with pytest.raises(ValueError) as error:
        easyfit.Model(make_net()).fit(*classification, precision="bf32", verbose=0)
    message = str(error.value)
    assert "'bf32'" in message and all(value in message for value in ("32", "16-mixed", "bf16-mixed", "64"))


def test_resuming_16_mixed_restores_the_loss_scaler(make_net, classification, tmp_path):
    path = tmp_path / "half.pt"
    first, resumed, straight = (easyfit.Model(make_net(), "cross_entropy", "adam", lr=0.02) for _ in range(3))
    options = {"batch_size": 16, "precision": "16-mixed", "verbose": 0}
    first.fit(*classification, epochs=2, **options)
    first.save(path)
    resumed.fit(*classification, epochs=4, resume_from=path, **options)
    straight.fit(*classification, epochs=4, **options)
    torch.testing.assert_close(resumed.net.state_dict(), straight.net.state_dict(), atol=1e-6, rtol=0)
    resumed.save(path)
    assert load_checkpoint_file(path)["scaler"]["_growth_tracker"] == 4 * 7


def test_in_memory_data_follows_the_net_dtype_unless_the_backend_casts_its_inputs():
    """A net held in bf16 by a backend that casts its own inputs (DeepSpeed) gets float32 data: targets of a
    regression stay exact; any other bf16 net gets bf16 inputs."""
    from easyfit.data.conform import data_dtype
    from easyfit.distributed.strategies.deepspeed import DeepSpeedPrecision
    from easyfit.parts.precision import Precision
    net = torch.nn.Linear(3, 1).to(torch.bfloat16)
    assert data_dtype(net, Precision("bf16-mixed")) == torch.bfloat16
    assert data_dtype(net, DeepSpeedPrecision("bf16-mixed")) == torch.float32
