"""Weights as safetensors files (the format Hugging Face and timm share): save_weights / load_weights / Model.load
of a *.safetensors path round trip exactly, the file is safetensors' own, and weights that do not fit the net are
refused by name, leaving the net as it was."""
from __future__ import annotations

import os

import pytest
import torch
from torch import nn

import easyfit

safetensors_torch = pytest.importorskip("safetensors.torch", reason="pip install easyfit[safetensors]")


def conv_net(width: int = 4) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(1, width, 3), nn.BatchNorm2d(width), nn.ReLU(), nn.Flatten(),
                         nn.Linear(width * 36, 3))


class Tied(nn.Module):
    """An embedding and an output layer sharing one weight, as language models tie them."""

    def __init__(self):
        super().__init__()
        self.embed, self.out = nn.Embedding(10, 4), nn.Linear(4, 10, bias=False)
        self.out.weight = self.embed.weight

    def forward(self, ids):
        return self.out(self.embed(ids))


def trained(net: nn.Module) -> easyfit.Model:
    model = easyfit.Model(net, "cross_entropy", "sgd", lr=0.1)
    generator = torch.Generator().manual_seed(0)
    model.fit(torch.randn(16, 1, 8, 8, generator=generator), torch.randint(0, 3, (16,), generator=generator),
              epochs=1, batch_size=8, verbose=0)   # moves the BatchNorm statistics and their int64 counter too
    return model


def assert_same_state(left: dict, right: dict) -> None:
    assert sorted(left) == sorted(right)   # safetensors keeps the names sorted
    for key in left:
        assert left[key].dtype == right[key].dtype and torch.equal(left[key], right[key]), key


def test_a_round_trip_is_exact_and_the_file_is_safetensors_own(tmp_path):
    model = trained(conv_net())
    path = tmp_path / "w.safetensors"
    model.save_weights(path)
    assert os.listdir(tmp_path) == ["w.safetensors"]
    assert_same_state(safetensors_torch.load_file(path), model.net.state_dict())   # what HF and timm read
    fresh = easyfit.Model(conv_net())
    fresh.net[0].weight.data.zero_()
    fresh.load_weights(path)
    assert_same_state(fresh.net.state_dict(), model.net.state_dict())


def test_model_load_of_a_safetensors_file_takes_the_weights_and_the_parts_given(tmp_path):
    model = trained(conv_net())
    model.save_weights(tmp_path / "w.safetensors")
    loaded = easyfit.Model.load(tmp_path / "w.safetensors", net=conv_net(), optimizer="sgd", metrics=["accuracy"],
                                lr=0.5)
    assert_same_state(loaded.net.state_dict(), model.net.state_dict())
    assert isinstance(loaded.optimizer, torch.optim.SGD) and loaded.optimizer.param_groups[0]["lr"] == 0.5
    assert loaded.metrics.names == ["accuracy"]


def test_tied_weights_are_saved_and_loaded(tmp_path):
    model = easyfit.Model(Tied())
    model.save_weights(tmp_path / "w.safetensors")
    fresh = Tied()
    with torch.no_grad():
        fresh.embed.weight.zero_()
    easyfit.Model(fresh).load_weights(tmp_path / "w.safetensors")
    assert torch.equal(fresh.out.weight, model.net.out.weight) and fresh.out.weight is fresh.embed.weight


def test_weights_that_do_not_fit_are_refused_by_name_and_change_nothing(tmp_path):
    easyfit.Model(conv_net(width=4)).save_weights(tmp_path / "w.safetensors")
    wider = easyfit.Model(conv_net(width=5))
    before = {key: value.clone() for key, value in wider.net.state_dict().items()}
    with pytest.raises(ValueError, match=r"0\.weight: the net has \(5, 1, 3, 3\), the file \(4, 1, 3, 3\)"):
        wider.load_weights(tmp_path / "w.safetensors")
    assert_same_state(wider.net.state_dict(), before)
    other = easyfit.Model(nn.Sequential(nn.Linear(4, 3)))
    with pytest.raises(ValueError, match=r"not in the net 1\.num_batches_tracked, .*0\.weight: the net has \(3, 4\)"):
        other.load_weights(tmp_path / "w.safetensors")


def test_a_file_that_is_not_safetensors_is_refused_saying_so(tmp_path):
    (tmp_path / "w.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match=r"w\.safetensors' is not a safetensors file"):
        easyfit.Model(conv_net()).load_weights(tmp_path / "w.safetensors")
