"""loss="model": the targets go into the net's forward (`labels=`), the net trains on the `loss` its output carries,
and metrics, predict and a loss given by name take the output's `logits` (easyfit.parts.outputs). Each equals a
plain PyTorch loop on the same batches."""
from __future__ import annotations

from typing import NamedTuple

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import easyfit
from easyfit.callbacks import ModelCheckpoint
from easyfit.parts.outputs import ModelLoss, prediction

BATCH, LR = 16, 0.1


class Output(NamedTuple):
    loss: torch.Tensor | None
    logits: torch.Tensor


class OwnLoss(nn.Module):
    """A net in the transformers manner: forward(x, labels=None) returns its logits and, given labels, its loss."""

    def __init__(self, form: str = "dict"):
        super().__init__()
        torch.manual_seed(0)
        self.hidden, self.head, self.form = nn.Linear(4, 8), nn.Linear(8, 3), form

    def forward(self, x, labels=None):
        logits = self.head(torch.tanh(self.hidden(x)))
        loss = None if labels is None else F.cross_entropy(logits, labels)
        if self.form == "tuple":
            return Output(loss, logits)
        if self.form == "tensor":
            return logits
        return {"loss": loss, "logits": logits} if loss is not None else {"logits": logits}


def data(samples: int = 64):
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(samples, 4, generator=generator)
    return x, (x[:, 0] > 0).long() + (x[:, 1] > 1).long()


def plain_loop(x, y, epochs: int = 2, accumulate: int = 1) -> tuple[list[float], dict]:
    net = OwnLoss("tensor")
    optimizer = torch.optim.SGD(net.parameters(), lr=LR)
    losses, batches = [], list(zip(x.split(BATCH), y.split(BATCH)))
    for _ in range(epochs):
        total = 0.0
        for step, (inputs, target) in enumerate(batches):
            loss = F.cross_entropy(net(inputs), target)
            (loss / accumulate).backward()
            if (step + 1) % accumulate == 0 or step + 1 == len(batches):
                optimizer.step()
                optimizer.zero_grad()
            total += float(loss.detach()) * len(inputs)
        losses.append(total / len(x))
    return losses, net.state_dict()


def fit(net, data_, y=None, loss="model", **kwargs):
    model = easyfit.Model(net, loss, "sgd", lr=LR, metrics=["accuracy"])
    history = model.fit(data_, y, batch_size=BATCH, epochs=kwargs.pop("epochs", 2), shuffle=False, verbose=0,
                        **kwargs)
    return model, history


def assert_like(history, net, expected) -> None:
    losses, weights = expected
    assert history.history["loss"] == pytest.approx(losses, abs=1e-5)
    for name, value in net.state_dict().items():
        torch.testing.assert_close(value, weights[name], atol=1e-5, rtol=0)


@pytest.mark.parametrize("form", ["dict", "tuple"])
def test_the_net_trains_on_its_own_loss_like_a_plain_loop(form):
    x, y = data()
    net = OwnLoss(form)
    model, history = fit(net, x, y)
    assert_like(history, net, plain_loop(x, y))
    assert isinstance(model.loss_fn, ModelLoss)
    with torch.no_grad():
        logits = prediction(net(x))
    torch.testing.assert_close(model.predict(x), logits)   # predict returns the logits
    scores = model.evaluate(x, y, verbose=0, return_dict=True)   # the loss the net computes, labels given
    assert scores["loss"] == pytest.approx(float(F.cross_entropy(logits, y)), abs=1e-5)
    assert scores["accuracy"] == pytest.approx(float((logits.argmax(1) == y).float().mean()))


@pytest.mark.parametrize("key", ["labels", "label", "y"])
def test_dict_batches_pass_their_targets_into_the_forward(key):
    x, y = data()
    rows = [{"x": row, key: label} for row, label in zip(x, y)]
    net = OwnLoss()
    assert_like(fit(net, rows)[1], net, plain_loop(x, y))


def test_the_targets_go_under_the_key_the_forward_names():
    class TakesY(OwnLoss):
        def forward(self, x, y=None):
            return super().forward(x, labels=y)
    x, y = data()
    net = TakesY()
    assert_like(fit(net, [{"x": row, "y": label} for row, label in zip(x, y)])[1], net, plain_loop(x, y))


def test_gradient_accumulation_averages_the_micro_batches():
    x, y = data()
    net = OwnLoss()
    assert_like(fit(net, x, y, gradient_accumulation_steps=2)[1], net, plain_loop(x, y, accumulate=2))


@pytest.mark.parametrize("form", ["dict", "tuple"])
def test_a_loss_by_name_takes_the_logits_of_a_structured_output(form):
    x, y = data()
    net = OwnLoss(form)
    model, history = fit(net, x, y, loss="cross_entropy")
    assert_like(history, net, plain_loop(x, y))
    assert model.predict(x).shape == (64, 3)


def test_bf16_mixed_trains_and_predicts_float32_logits():
    x, y = data()
    model, history = fit(OwnLoss(), x, y, precision="bf16-mixed", epochs=3)
    losses = history.history["loss"]
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0]
    assert model.predict(x).dtype == torch.float32


@pytest.mark.filterwarnings("ignore:resuming")
def test_a_checkpoint_restores_the_model_loss_and_a_resumed_fit_equals_an_uninterrupted_one(tmp_path):
    x, y = data()
    net = OwnLoss()
    fit(net, x, y, epochs=1, callbacks=[ModelCheckpoint(tmp_path / "epoch.pt")])
    loaded = easyfit.Model.load(tmp_path / "epoch.pt", OwnLoss())
    assert isinstance(loaded.loss_fn, ModelLoss)
    resumed = OwnLoss()
    _, history = fit(resumed, x, y, epochs=2, resume_from=tmp_path / "epoch.pt")
    assert_like(history, resumed, plain_loop(x, y))


def test_loss_none_and_a_misspelt_name_point_to_model():
    with pytest.raises(TypeError, match="loss='model'"):
        easyfit.Model(OwnLoss(), loss=None)
    with pytest.raises(ValueError, match="Did you mean 'model'"):
        easyfit.Model(OwnLoss(), loss="modle")


def test_what_cannot_train_on_the_net_s_own_loss_is_said_before_training():
    x, y = data()
    with pytest.raises(ValueError, match="holds no target: its keys are 'x'"):
        fit(OwnLoss(), [{"x": row} for row in x])
    with pytest.raises(ValueError, match="takes no target argument"):
        fit(nn.Linear(4, 3), x, y)
    with pytest.raises(ValueError, match="no 'loss' tensor"):
        fit(OwnLoss("tensor"), x, y)
    with pytest.raises(ValueError, match="sample and class weights"):
        fit(OwnLoss(), x, y, sample_weight=torch.ones(64))


@pytest.mark.timeout(300)
def test_compiled_steps_train_on_the_net_s_own_loss():
    x, y = data()
    net = OwnLoss()
    model, history = fit(net, x, y, compile=True)
    assert_like(history, net, plain_loop(x, y))
    torch.testing.assert_close(model.predict(x, compile=True), prediction(net(x)).detach(), atol=1e-5, rtol=0)


class TinyGPT(nn.Module):
    """A GPT whose forward takes targets=: (logits, loss) with targets, else (the last position's logits, None)."""

    def __init__(self, vocab: int = 16, length: int = 8, width: int = 16):
        super().__init__()
        torch.manual_seed(0)
        self.tokens, self.positions = nn.Embedding(vocab, width), nn.Embedding(length, width)
        self.attention = nn.MultiheadAttention(width, 2, batch_first=True)
        self.norm, self.head = nn.LayerNorm(width), nn.Linear(width, vocab, bias=False)

    def forward(self, idx, targets=None):
        x = self.tokens(idx) + self.positions(torch.arange(idx.shape[1], device=idx.device))
        causal = torch.triu(torch.ones(idx.shape[1], idx.shape[1], dtype=torch.bool, device=idx.device), 1)
        x = self.norm(x + self.attention(x, x, x, attn_mask=causal, need_weights=False)[0])
        if targets is None:
            return self.head(x[:, [-1], :]), None
        logits = self.head(x)
        return logits, F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)


def test_a_gpt_whose_forward_takes_targets_trains_on_its_own_loss_like_a_plain_loop():
    """fit(X, Y) passes Y as targets= and trains on the loss of the (logits, loss) tuple; 8 x 2 accumulated."""
    tokens = torch.randint(0, 16, (32, 9), generator=torch.Generator().manual_seed(0))
    x, y = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    net, plain = TinyGPT(), TinyGPT()
    optimizer = torch.optim.SGD(plain.parameters(), lr=LR)
    for _ in range(2):
        for step, (inputs, targets) in enumerate(zip(x.split(8), y.split(8))):
            (plain(inputs, targets)[1] / 2).backward()
            if step % 2 == 1:
                optimizer.step()
                optimizer.zero_grad()
    model = easyfit.Model(net, "model", "sgd", lr=LR)
    model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0, gradient_accumulation_steps=2)
    for name, value in plain.state_dict().items():
        torch.testing.assert_close(net.state_dict()[name], value, atol=1e-6, rtol=0)
    with torch.no_grad():
        expected = float(plain(x, y)[1])
    assert model.evaluate(x, y, batch_size=32, verbose=0) == pytest.approx(expected, abs=1e-6)
