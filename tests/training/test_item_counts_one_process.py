"""Losses over counted items (tokens) on one process: every optimizer step made of micro-batches trains on the
combined batch's mean over its items, and the History and evaluate give that mean too (2 ranks:
tests/distributed/test_item_counts.py; the cases: tests/distributed/scripts/item_counts.py)."""
import functools
import importlib.util
import os
import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import easyfit
from easyfit.parts.item_counts import ClassIndexItems, ModelItems, ModelMeanItems, OwnItems, item_counting
from easyfit.parts.losses import resolve_loss

sys.path.insert(0, str(Path(__file__).parents[1] / "distributed" / "scripts"))
import item_counts as cases

NEEDS_TRANSFORMERS = pytest.mark.skipif(importlib.util.find_spec("transformers") is None or
                                        importlib.util.find_spec("datasets") is None,
                                        reason="pip install transformers datasets")
#: drawn token cases per run (ITEM_COUNT_DRAWS=200 for a long run)
DRAWS = int(os.environ.get("ITEM_COUNT_DRAWS", 6))
TOLERANCE = 1e-5


@NEEDS_TRANSFORMERS
@pytest.mark.parametrize("kind", cases.HF_KINDS)
def test_a_transformers_model_s_step_of_micro_batches_is_one_step_on_all_its_tokens(kind):
    """The issue's probe: 8 sequences (4 with 11 real tokens, 4 with 2), loss="model", one SGD step at lr 0.5 in
    micro-batches against one plain step over all 8."""
    plain = cases.plain_hf(kind)
    for accumulate in (2, 4):
        weights, loss = cases.difference(cases.fit_hf(kind, accumulate), plain)
        assert weights < TOLERANCE and loss < TOLERANCE, (kind, accumulate, weights, loss)


@pytest.mark.parametrize("case", cases.draw(51, DRAWS, ranks=(1,), compiles=False) +
                         [{**cases.draw(7, 1, ranks=(1,))[0], "compile": True, "accumulate": 3}], ids=repr)
def test_token_losses_match_plain_pytorch_on_the_combined_batch(case):
    """Drawn padding patterns, accumulation 1-4, the three ways to give the loss, compile= on or off: weights, the
    epoch's loss and evaluate's loss against plain PyTorch on each step's combined batch."""
    differences = cases.difference(cases.fit_tokens(case), cases.plain_tokens(case))
    assert max(differences) < TOLERANCE, differences


class MaskedMean:
    """A user's loss over tokens: the mean over the targets other than -100, and how many those are."""

    def __call__(self, output, target):
        mask = target != -100
        values = F.cross_entropy(output, target.clamp(min=0), reduction="none")
        return (values * mask).sum() / mask.sum().clamp(min=1)

    def item_count(self, target):
        return (target != -100).sum()


def test_a_loss_of_the_user_s_takes_part_through_item_count():
    """A user's loss that says how many items its mean is over is weighted by them, as the named losses are."""
    case = {**cases.draw(3, 1, ranks=(1,), compiles=False)[0], "accumulate": 2, "pattern": "long_and_short"}
    differences = cases.difference(cases.fit_tokens(case, MaskedMean()), cases.plain_tokens(case))
    assert max(differences) < TOLERANCE, differences


def test_evaluate_s_loss_is_the_mean_over_every_counted_item():
    x, y = cases.token_data({"seed": 4, "pattern": "long_and_short", "batch": 3, "accumulate": 1, "ranks": 1,
                             "steps": 3})
    net = cases.new_token_net()
    model = easyfit.Model(net, loss=nn.CrossEntropyLoss(ignore_index=-100), optimizer="sgd")
    with torch.no_grad():
        expected = F.cross_entropy(net(x), y).item()
    assert model.evaluate(x, y, batch_size=4, verbose=0) == pytest.approx(expected, rel=1e-6)


def test_class_targets_of_one_dimension_train_as_before():
    """A classification cross entropy over (batch,) targets stays a per-batch mean (each micro-batch's mean over
    the accumulation steps, a short last window too): the same numbers as before, bit for bit."""
    torch.manual_seed(0)
    x, y, net = torch.randn(10, 4), torch.randint(0, 3, (10,)), nn.Linear(4, 3)
    plain = nn.Linear(4, 3)
    plain.load_state_dict(net.state_dict())
    model = easyfit.Model(net, loss="cross_entropy", optimizer=functools.partial(torch.optim.SGD, lr=0.5))
    model.fit(x, y, epochs=1, batch_size=4, gradient_accumulation_steps=2, shuffle=False, verbose=0)
    optimizer = torch.optim.SGD(plain.parameters(), lr=0.5)
    for window in ((0, 4), (8,)):
        optimizer.zero_grad()
        for start in window:
            (F.cross_entropy(plain(x[start:start + 4]), y[start:start + 4]) / 2).backward()
        optimizer.step()
    assert all(torch.equal(a, b) for a, b in zip(net.parameters(), plain.parameters()))


def test_which_losses_are_counted():
    assert isinstance(item_counting(resolve_loss("cross_entropy")), ClassIndexItems)
    assert isinstance(item_counting(resolve_loss("nll")), ClassIndexItems)
    assert isinstance(item_counting(functools.partial(F.cross_entropy, ignore_index=0)), ClassIndexItems)
    assert item_counting(functools.partial(F.cross_entropy, reduction="sum")) is None
    assert item_counting(nn.CrossEntropyLoss(weight=torch.ones(3))) is None
    assert item_counting(nn.CrossEntropyLoss(reduction="sum")) is None
    assert item_counting(resolve_loss("mse")) is None
    assert item_counting(lambda output, target: output.mean()) is None
    assert item_counting(resolve_loss("model"), nn.Linear(2, 2)) is None

    class Counted:
        def __call__(self, output, target):
            return output.mean()

        def item_count(self, target):
            return 3
    assert isinstance(item_counting(Counted()), OwnItems)


@NEEDS_TRANSFORMERS
def test_which_transformers_models_are_counted():
    from transformers import BertConfig, BertForSequenceClassification
    model_loss = resolve_loss("model")
    counted = item_counting(model_loss, cases.new_hf_model("causal_lm"))
    assert type(counted) is ModelItems and counted.shifted
    # BERT's masked LM and token classifier compute their mean themselves (CrossEntropyLoss()): the mean times the
    # count of labels other than -100
    for kind in ("masked_lm", "token_classifier"):
        counted = item_counting(model_loss, cases.new_hf_model(kind))
        assert type(counted) is ModelMeanItems and not counted.shifted
    config = BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=32, max_position_embeddings=16)
    assert item_counting(model_loss, BertForSequenceClassification(config)) is None


@NEEDS_TRANSFORMERS
def test_a_micro_batch_of_padding_only_adds_nothing(monkeypatch):
    """A token classifier whose second micro-batch holds no label but -100: its mean is NaN (0 / 0), its share 0."""
    rows = cases.hf_rows

    def padded(kind):
        data = rows(kind)
        data["labels"][4:] = -100
        return data
    monkeypatch.setattr(cases, "hf_rows", padded)
    weights, loss = cases.difference(cases.fit_hf("token_classifier", 2), cases.plain_hf("token_classifier"))
    assert weights < TOLERANCE and loss < TOLERANCE, (weights, loss)


def test_sample_weights_with_a_loss_over_counted_items_are_refused_before_a_step():
    x, y = cases.token_data({"seed": 4, "pattern": "uniform", "batch": 2, "accumulate": 1, "ranks": 1, "steps": 2})
    net = cases.new_token_net()
    before = [p.detach().clone() for p in net.parameters()]
    model = easyfit.Model(net, loss="cross_entropy", optimizer="sgd")
    with pytest.raises(ValueError, match="weigh whole samples, but this loss averages over counted items"):
        model.fit(x, y, sample_weight=torch.ones(len(x)), epochs=1, batch_size=2, verbose=0)
    assert all(torch.equal(a, b) for a, b in zip(before, net.parameters()))
