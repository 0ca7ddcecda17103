"""CUDA paths for real: DataParallel, NCCL, mixed precision with a gradient scaler. Skipped without a GPU."""
from __future__ import annotations

import copy

import pytest
import torch
from nets import tiny_net

import easyfit

pytestmark = pytest.mark.gpu


def plain_cuda_weights(net: torch.nn.Module, x, y, lr: float, batch_size: int, epochs: int) -> dict:
    net = copy.deepcopy(net).cuda()
    optimizer = torch.optim.SGD(net.parameters(), lr=lr)
    for _ in range(epochs):
        for start in range(0, len(x), batch_size):
            optimizer.zero_grad()
            loss = torch.nn.functional.cross_entropy(net(x[start:start + batch_size].cuda()),
                                                     y[start:start + batch_size].cuda())
            loss.backward()
            optimizer.step()
    return {name: value.cpu() for name, value in net.state_dict().items()}


def assert_close(actual: dict, expected: dict, atol: float) -> None:
    for name, value in expected.items():
        assert (actual[name].cpu() - value).abs().max().item() <= atol, name


@pytest.mark.parametrize("strategy", ["single", "dp"])
def test_cuda_training_matches_plain_pytorch(strategy, classification):
    x, y = classification
    net = tiny_net()
    expected = plain_cuda_weights(net, x, y, lr=0.1, batch_size=16, epochs=2)
    model = easyfit.Model(net, "cross_entropy", "sgd", lr=0.1)
    model.fit(x, y, epochs=2, batch_size=16, shuffle=False, verbose=0, accelerator="gpu", devices=1,
              strategy=strategy)
    assert next(net.parameters()).is_cuda
    assert_close(net.state_dict(), expected, atol=1e-5)


def test_ddp_with_nccl_on_one_gpu_matches_plain_pytorch(classification):
    x, y = classification
    net = tiny_net()
    expected = plain_cuda_weights(net, x, y, lr=0.1, batch_size=16, epochs=2)
    model = easyfit.Model(net, "cross_entropy", "sgd", lr=0.1)
    model.fit(x, y, epochs=2, batch_size=16, shuffle=False, verbose=0, accelerator="gpu", devices=1,
              strategy=easyfit.strategies.DDP(process_group_backend="nccl"))
    assert model.strategy.process_group_backend == "nccl"
    assert_close(net.state_dict(), expected, atol=1e-5)
    scores = model.evaluate(x, y, verbose=0, return_dict=True, accelerator="gpu", devices=1, strategy="ddp")
    assert 0 <= scores["loss"] < 2


@pytest.mark.parametrize("precision", ["16-mixed", "bf16-mixed"])
def test_cuda_mixed_precision_trains_and_resumes(precision, classification, tmp_path):
    x, y = classification
    model = easyfit.Model(tiny_net(), "cross_entropy", "adam", metrics=["accuracy"], lr=0.01)
    history = model.fit(x, y, epochs=6, batch_size=16, verbose=0, accelerator="gpu", precision=precision,
                        gradient_clip_val=1.0)
    assert history.history["loss"][-1] < history.history["loss"][0]
    model.save(tmp_path / "run.pt")
    state = torch.load(tmp_path / "run.pt", weights_only=True)
    if precision == "16-mixed":
        assert state["scaler"]["scale"] > 0, "the gradient scaler's state is saved"
    predictions = model.predict(x, accelerator="gpu", verbose=0)
    assert predictions.dtype == torch.float32 or precision == "bf16-mixed"
