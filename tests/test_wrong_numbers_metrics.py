"""Classification metrics on real data against scikit-learn: the same numbers at every batch size, for logits and
probabilities, class indices, one-hot and multi-label targets."""
from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from sklearn import datasets, metrics as sk
from torch import nn
from torch.nn import functional as F

import easyfit


@pytest.fixture(scope="module")
def breast_cancer():
    x, y = datasets.load_breast_cancer(return_X_y=True)
    return torch.from_numpy((x - x.mean(0)) / x.std(0)).float(), torch.from_numpy(y).float()[:, None]


@pytest.fixture(scope="module")
def digits():
    x, y = datasets.load_digits(return_X_y=True)
    return torch.from_numpy(x / 16).float(), torch.from_numpy(y)


def small_logits_net(in_features: int, out_features: int) -> nn.Module:
    """Untrained, with logits of a few tenths: many batches hold only logits in [0, 1]."""
    torch.manual_seed(0)
    net = nn.Linear(in_features, out_features)
    with torch.no_grad():
        net.weight.mul_(0.3)
    return net


@pytest.mark.parametrize("loss", ["bce_with_logits", "bce", nn.BCEWithLogitsLoss(), F.binary_cross_entropy_with_logits])
def test_binary_metrics_do_not_depend_on_the_batch_size(loss, breast_cancer):
    x, y = breast_cancer
    logits = loss in ("bce_with_logits", F.binary_cross_entropy_with_logits) or isinstance(loss, nn.Module)
    net = small_logits_net(30, 1) if logits else nn.Sequential(small_logits_net(30, 1), nn.Sigmoid())
    model = easyfit.Model(net, loss, "sgd", metrics=["accuracy", "auroc", "f1", "precision", "recall"])
    probabilities = net(x).detach().flatten()
    if logits:
        probabilities = probabilities.sigmoid()
    labels, predicted = y.flatten().long(), (probabilities > 0.5).long()
    expected = {"accuracy": sk.accuracy_score(labels, predicted), "auroc": sk.roc_auc_score(labels, probabilities),
                "f1": sk.f1_score(labels, predicted), "precision": sk.precision_score(labels, predicted),
                "recall": sk.recall_score(labels, predicted)}
    for batch_size in (1, 8, 32):
        scores = model.evaluate(x, y, batch_size=batch_size, verbose=0, return_dict=True)
        assert {key: scores[key] for key in expected} == pytest.approx(expected, abs=1e-5), batch_size


def test_multiclass_auroc_on_logits_does_not_depend_on_the_batch_size(digits):
    x, y = digits
    net = small_logits_net(64, 10)
    model = easyfit.Model(net, "cross_entropy", "sgd", metrics=["accuracy", "auroc"])
    probabilities = net(x).detach().softmax(1)
    expected = {"accuracy": sk.accuracy_score(y, probabilities.argmax(1)),
                "auroc": sk.roc_auc_score(y, probabilities, multi_class="ovr", average="macro")}
    for batch_size in (1, 7, 64):
        scores = model.evaluate(x, y, batch_size=batch_size, verbose=0, return_dict=True)
        assert {key: scores[key] for key in expected} == pytest.approx(expected, abs=1e-5), batch_size


MIXED = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}


@pytest.mark.parametrize("precision", ["32", *MIXED])
def test_binary_accuracy_of_small_positive_logits_is_one_in_every_precision(precision):
    """Logits in (5e-4, 3e-3] for targets 1: every one is above 0, so accuracy is 1.0 by hand, with or without
    auroc (a bf16 sigmoid rounded them to exactly 0.5: accuracy 0.0)."""
    net = nn.Linear(1, 1)
    with torch.no_grad():
        net.weight.fill_(1.0)
        net.bias.zero_()
    x = 5e-4 + 2.5e-3 * torch.rand(4000, 1, generator=torch.Generator().manual_seed(0))
    for metrics in (["accuracy"], ["accuracy", "auroc", "f1"]):
        model = easyfit.Model(net, "bce_with_logits", "sgd", metrics=metrics)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")   # auroc of one class only: 0, with a warning
            scores = model.evaluate(x, torch.ones(4000, 1), batch_size=256, verbose=0, return_dict=True,
                                    precision=precision)
        assert scores["accuracy"] == 1.0, (precision, metrics)
        assert scores.get("f1", 1.0) == 1.0, (precision, metrics)


@pytest.mark.parametrize("precision", MIXED)
def test_multiclass_metrics_under_mixed_precision_are_those_of_plain_pytorch_outputs(precision, digits):
    """Accuracy is the argmax of plain PyTorch's autocast outputs, the same with auroc beside it; auroc is
    scikit-learn's on their softmax in float32."""
    x, y = digits
    net = small_logits_net(64, 10)
    with torch.no_grad():
        net.weight.mul_(0.05)   # logits within a few hundredths: a low-precision softmax ties many of them
    with torch.no_grad(), torch.autocast("cpu", dtype=MIXED[precision]):
        logits = net(x)
    assert logits.dtype == MIXED[precision]
    expected = {"accuracy": sk.accuracy_score(y, logits.float().argmax(1)),
                "auroc": sk.roc_auc_score(y, logits.float().softmax(1), multi_class="ovr", average="macro")}
    for metrics in (["accuracy"], ["accuracy", "auroc"]):
        model = easyfit.Model(net, "cross_entropy", "sgd", metrics=metrics)
        scores = model.evaluate(x, y, batch_size=128, verbose=0, return_dict=True, precision=precision)
        assert {key: scores[key] for key in metrics} == pytest.approx({key: expected[key] for key in metrics},
                                                                      abs=1e-6), metrics


def test_one_hot_targets_are_a_multiclass_task(digits):
    x, y = digits
    one_hot = F.one_hot(y, 10).float()
    net = nn.Linear(64, 10)
    model = easyfit.Model(net, "cross_entropy", "adam", metrics=["accuracy", "f1", "auroc", "top3_accuracy"], lr=0.01)
    history = model.fit(x, one_hot, epochs=2, batch_size=32, verbose=0).history
    probabilities = net(x).detach().softmax(1)
    predicted = probabilities.argmax(1)
    scores = model.evaluate(x, one_hot, batch_size=50, verbose=0, return_dict=True)
    assert scores["accuracy"] == pytest.approx(sk.accuracy_score(y, predicted), abs=1e-6) and scores["accuracy"] > 0.8
    assert scores["f1"] == pytest.approx(sk.f1_score(y, predicted, average="macro"), abs=1e-5)
    assert scores["auroc"] == pytest.approx(sk.roc_auc_score(y, probabilities, multi_class="ovr"), abs=1e-5)
    assert scores["top3_accuracy"] == pytest.approx(sk.top_k_accuracy_score(y, probabilities, k=3), abs=1e-6)
    assert history["accuracy"][-1] > 0.8


@pytest.mark.parametrize("loss", ["bce_with_logits", "mse"])
def test_multi_label_targets_are_a_multilabel_task(loss, digits):
    x, y = digits
    labels = torch.stack([y % 2 == 0, y > 4, (y == 0) | (y >= 8)], dim=1).float()   # several 1s in many rows
    torch.manual_seed(0)
    net = nn.Linear(64, 3)
    model = easyfit.Model(net, loss, "adam", metrics=["accuracy", "f1", "precision", "recall", "auroc"], lr=0.01)
    model.fit(x, labels, epochs=2, verbose=0)
    outputs = net(x).detach()
    probabilities = outputs.sigmoid() if loss == "bce_with_logits" else outputs.clamp(0, 1)
    predicted = (probabilities > 0.5).long()
    scores = model.evaluate(x, labels, batch_size=16, verbose=0, return_dict=True)
    assert scores["accuracy"] == pytest.approx((predicted == labels).float().mean().item(), abs=1e-6)
    assert scores["accuracy"] > 0.7
    assert scores["f1"] == pytest.approx(sk.f1_score(labels, predicted, average="macro"), abs=1e-5)
    assert scores["precision"] == pytest.approx(sk.precision_score(labels, predicted, average="macro"), abs=1e-5)
    assert scores["recall"] == pytest.approx(sk.recall_score(labels, predicted, average="macro"), abs=1e-5)
    assert scores["auroc"] == pytest.approx(sk.roc_auc_score(labels, probabilities, average="macro"), abs=1e-5)


def test_top_k_accuracy_on_a_multi_label_task_is_refused(digits):
    x, y = digits
    labels = torch.stack([y % 2 == 0, y > 4, y == 0, y == 1], dim=1).float()
    model = easyfit.Model(nn.Linear(64, 4), "bce_with_logits", "sgd", metrics=["top3_accuracy"])
    with pytest.raises(ValueError, match="needs a multiclass task"):
        model.evaluate(x, labels, verbose=0, return_dict=True)


def test_regression_metrics_see_the_outputs_unchanged():
    x, y = datasets.load_diabetes(return_X_y=True)
    x, y = torch.from_numpy(x).float(), torch.from_numpy(y).float()[:, None] / 100
    net = nn.Linear(10, 1)
    scores = easyfit.Model(net, "mse", "sgd", metrics=["mae", "r2"]).evaluate(x, y, batch_size=16, verbose=0,
                                                                              return_dict=True)
    output = net(x).detach().numpy()
    assert scores["mae"] == pytest.approx(sk.mean_absolute_error(y, output), rel=1e-5)
    assert scores["r2"] == pytest.approx(sk.r2_score(y, output), rel=1e-5)


def test_probability_targets_that_are_no_classes_are_refused_for_accuracy(digits):
    x, _ = digits
    model = easyfit.Model(nn.Linear(64, 3), "mse", "sgd", metrics=["accuracy"])
    with pytest.raises(ValueError, match="classification metrics need class targets"):
        model.evaluate(x, torch.full((len(x), 3), 2.5), verbose=0, return_dict=True)


def test_numpy_one_hot_from_keras_habits(digits):
    x, y = digits
    one_hot = np.eye(10, dtype="float32")[y.numpy()]
    net = nn.Linear(64, 10)
    scores = easyfit.Model(net, "categorical_crossentropy", "sgd", metrics=["acc"]).evaluate(x.numpy(), one_hot,
                                                                                           verbose=0, return_dict=True)
    assert scores["acc"] == pytest.approx(sk.accuracy_score(y, net(x).argmax(1)), abs=1e-6)
