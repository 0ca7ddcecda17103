"""evaluate's loss and metrics against hand computations; losses by name, module and callable."""
from __future__ import annotations

import pytest
import torch
from nets import mean_of_batch_maxima
from sklearn import metrics as sk
from torch import nn
from torch.nn import functional as F

import easyfit
from easyfit.parts import metrics as metrics_module
from easyfit.parts.losses import LOSSES
from easyfit.parts.metrics import MetricSet


def scores_and_outputs(net, x, y, loss, metrics):
    """evaluate() in batches of 8 (uneven last batch), and the net's outputs over all of x."""
    scores = easyfit.Model(net, loss, "sgd", metrics=metrics).evaluate(x, y, batch_size=8, verbose=0, return_dict=True)
    return scores, net(x).detach()


def test_loss_is_the_sample_weighted_mean_over_an_uneven_last_batch(make_net, classification):
    x, y = classification
    scores, output = scores_and_outputs(make_net(), x, y, "cross_entropy", None)
    assert scores == {"loss": pytest.approx(F.cross_entropy(output, y).item(), abs=1e-6)}


def test_multiclass_metrics_by_name(make_net, classification):
    x, _ = classification
    y = torch.randint(0, 10, (len(x),), generator=torch.Generator().manual_seed(3))
    scores, output = scores_and_outputs(make_net(out_features=10), x, y, "cross_entropy",
                                        ["accuracy", "top5_accuracy", "f1", "auroc"])
    top5 = (output.topk(5).indices == y[:, None]).any(dim=1).float().mean()
    assert scores["accuracy"] == pytest.approx((output.argmax(1) == y).float().mean().item(), abs=1e-6)
    assert scores["top5_accuracy"] == pytest.approx(top5.item(), abs=1e-6)
    assert scores["f1"] == pytest.approx(sk.f1_score(y, output.argmax(1), average="macro"), abs=1e-5)
    assert scores["auroc"] == pytest.approx(
        sk.roc_auc_score(y, output.softmax(1), multi_class="ovr", average="macro"), abs=1e-5)


@pytest.mark.parametrize("target_shape", ["column", "flat"])
def test_binary_metrics_are_inferred_from_a_single_output(target_shape, make_net, classification):
    x, y = classification
    y = (y > 0).float()
    net = make_net(out_features=1)
    if target_shape == "flat":
        net.append(nn.Flatten(0))
    else:
        y = y[:, None]
    scores, output = scores_and_outputs(net, x, y, "bce_with_logits", ["accuracy", "f1", "auroc"])
    labels, probabilities = y.flatten().long(), output.flatten().sigmoid()
    assert scores["loss"] == pytest.approx(F.binary_cross_entropy_with_logits(output, y).item(), abs=1e-6)
    assert scores["accuracy"] == pytest.approx(((probabilities > 0.5).long() == labels).float().mean().item())
    assert scores["f1"] == pytest.approx(sk.f1_score(labels, probabilities > 0.5), abs=1e-5)
    assert scores["auroc"] == pytest.approx(sk.roc_auc_score(labels, probabilities), abs=1e-5)


def test_regression_metrics_by_name(make_net, regression):
    x, y = regression
    scores, output = scores_and_outputs(make_net(out_features=1), x, y, "mse", ["mae", "mse", "r2"])
    assert scores["loss"] == pytest.approx(F.mse_loss(output, y).item(), rel=1e-5)
    assert scores["mae"] == pytest.approx(F.l1_loss(output, y).item(), rel=1e-5)
    assert scores["mse"] == pytest.approx(F.mse_loss(output, y).item(), rel=1e-5)
    assert scores["r2"] == pytest.approx(sk.r2_score(y, output), rel=1e-4)


def test_torchmetrics_objects_and_a_dict_of_named_metrics(make_net, regression):
    torchmetrics = pytest.importorskip("torchmetrics")
    x, y = regression
    scores, output = scores_and_outputs(make_net(out_features=1), x, y, "mse", [torchmetrics.MeanAbsoluteError()])
    assert scores["mean_absolute_error"] == pytest.approx(F.l1_loss(output, y).item(), rel=1e-5)
    scores, _ = scores_and_outputs(make_net(out_features=1), x, y, "mse",
                                   {"err": torchmetrics.MeanSquaredError(), "abs_err": "mae"})
    assert scores.keys() == {"loss", "err", "abs_err"}
    assert scores["abs_err"] == pytest.approx(F.l1_loss(output, y).item(), rel=1e-5)


def test_metrics_reset_between_epochs(make_net, classification):
    history = easyfit.Model(make_net(), metrics=["accuracy"]).fit(*classification, epochs=3, verbose=0)
    assert all(0.0 <= value <= 1.0 for value in history.history["accuracy"])


def _loss_case(name: str, x: torch.Tensor):
    """(final layer for the net's 3 outputs, targets, reference loss on outputs) for each loss name."""
    generator = torch.Generator().manual_seed(4)
    classes = torch.randint(0, 3, (len(x),), generator=generator)
    bits = torch.randint(0, 2, (len(x), 3), generator=generator).float()
    values = torch.randn(len(x), 3, generator=generator)
    cases = {
        "cross_entropy": (nn.Identity(), classes, F.cross_entropy),
        "nll": (nn.LogSoftmax(1), classes, F.nll_loss),
        "mse": (nn.Identity(), values, F.mse_loss),
        "l1": (nn.Identity(), values, F.l1_loss),
        "bce": (nn.Sigmoid(), bits, F.binary_cross_entropy),
        "bce_with_logits": (nn.Identity(), bits, F.binary_cross_entropy_with_logits),
        "huber": (nn.Identity(), values, F.huber_loss),
        "smooth_l1": (nn.Identity(), values, F.smooth_l1_loss),
        "kl_div": (nn.LogSoftmax(1), values.softmax(1), lambda o, t: F.kl_div(o, t, reduction="batchmean")),
        "poisson_nll": (nn.Identity(), bits * 3, F.poisson_nll_loss),
        "hinge_embedding": (nn.Identity(), bits * 2 - 1, F.hinge_embedding_loss),
    }
    aliases = {"categorical_crossentropy": "cross_entropy", "mean_squared_error": "mse", "mae": "l1",
               "mean_absolute_error": "l1", "binary_crossentropy": "bce"}
    return cases[aliases.get(name, name)]


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_every_loss_name_trains_and_evaluates_like_torch(name, make_net, classification):
    x = classification[0]
    head, target, reference = _loss_case(name, x)
    net = nn.Sequential(make_net(), head)
    model = easyfit.Model(net, name, "adam", lr=0.01)
    history = model.fit(x, target, epochs=4, batch_size=16, verbose=0)
    assert history.history["loss"][-1] < history.history["loss"][0]
    expected = reference(net(x), target).item()
    assert model.evaluate(x, target, batch_size=8, verbose=0) == pytest.approx(expected, rel=1e-5, abs=1e-6)


def test_loss_as_module_and_as_callable(make_net, classification):
    x, y = classification
    net = make_net()
    smoothed = nn.CrossEntropyLoss(label_smoothing=0.2)
    scores = easyfit.Model(net, smoothed).evaluate(x, y, batch_size=8, verbose=0, return_dict=True)
    assert scores["loss"] == pytest.approx(smoothed(net(x), y).item(), abs=1e-6)

    def doubled(output, target):
        return 2 * F.cross_entropy(output, target)
    scores = easyfit.Model(net, doubled).evaluate(x, y, batch_size=8, verbose=0, return_dict=True)
    assert scores["loss"] == pytest.approx(2 * F.cross_entropy(net(x), y).item(), abs=1e-6)
    history = easyfit.Model(net, doubled, "sgd").fit(x, y, epochs=3, verbose=0)
    assert history.history["loss"][-1] < history.history["loss"][0]


@pytest.mark.parametrize("names, make_target", [
    (["accuracy", "top3_accuracy", "f1", "precision", "recall", "auroc"],
     lambda g: torch.randint(0, 5, (24,), generator=g)),
    (["accuracy", "f1"], lambda g: torch.randint(0, 5, (24,), generator=g)),   # no softmax needed
    (["mae", "mse", "rmse", "r2"], lambda g: torch.randn(24, 5, generator=g)),
], ids=["classification", "classes-only", "regression"])
def test_named_metrics_take_waiting_batches_as_one(monkeypatch, names, make_target):
    """The named metrics take the batches in one update per WAIT_BATCHES; every value equals one update per batch
    (and sklearn's), and the user's own metric object, which depends on the batching, still sees each batch."""
    generator = torch.Generator().manual_seed(0)
    batches = [(torch.randn(24, 5, generator=generator), make_target(generator)) for _ in range(7)]
    batches.append((batches[0][0][:5], batches[0][1][:5]))   # a short last batch
    loss = LOSSES["cross_entropy" if names[0] == "accuracy" else "mse"]()
    values = []
    for wait in (1, 3, 16):   # one update per batch; every 3 batches and a compute in between; all at the end
        monkeypatch.setattr(metrics_module, "WAIT_BATCHES", wait)
        metrics = MetricSet({**{name: name for name in names}, "own": mean_of_batch_maxima()}, loss)
        for index, (output, target) in enumerate(batches):
            metrics.update(output, target)
            if index == 4:
                metrics.compute()
        values.append(metrics.compute())
    assert values[1] == pytest.approx(values[0], abs=1e-6) and values[2] == pytest.approx(values[0], abs=1e-6)
    output, target = (torch.cat(parts) for parts in zip(*batches))
    if "accuracy" in names:
        assert values[2]["accuracy"] == pytest.approx((output.argmax(1) == target).float().mean().item(), abs=1e-6)
        assert values[2]["f1"] == pytest.approx(sk.f1_score(target, output.argmax(1), average="macro"), abs=1e-5)
    else:
        assert values[2]["mse"] == pytest.approx(sk.mean_squared_error(target, output), abs=1e-5)
    one_batch = mean_of_batch_maxima()
    one_batch.update(output, None)
    assert float(one_batch.compute()) != pytest.approx(values[0]["own"], abs=1e-3)   # the batching shows


def test_batches_that_do_not_concatenate_wait_apart():
    """A batch whose outputs do not concatenate with the waiting ones (another dtype here) makes those be taken
    first; every batch counts once."""
    generator = torch.Generator().manual_seed(0)
    batches = [(torch.randn(8, 3, generator=generator), torch.randint(0, 3, (8,), generator=generator))
               for _ in range(4)]
    batches[3] = (batches[3][0].double(), batches[3][1])
    metrics = MetricSet(["accuracy"], LOSSES["cross_entropy"]())
    for output, target in batches:
        metrics.update(output, target)
    assert len(metrics.waiting) == 1   # the first batch was taken at once, the next two when the fourth came
    correct = sum(int((output.argmax(1) == target).sum()) for output, target in batches)
    assert metrics.compute() == {"accuracy": pytest.approx(correct / 32, abs=1e-7)}


def test_a_large_batch_is_taken_at_once(monkeypatch):
    monkeypatch.setattr(metrics_module, "WAIT_ELEMENTS", 30)
    generator = torch.Generator().manual_seed(0)
    batches = [(torch.randn(n, 3, generator=generator), torch.randint(0, 3, (n,), generator=generator))
               for n in (4, 4, 12, 4)]   # the third has 36 output elements
    metrics = MetricSet(["accuracy"], LOSSES["cross_entropy"]())
    for index, (output, target) in enumerate(batches):
        metrics.update(output, target)
        if index == 2:
            assert metrics.waiting == []   # the batch before it taken first, then it at once
    correct = sum(int((output.argmax(1) == target).sum()) for output, target in batches)
    assert metrics.compute() == {"accuracy": pytest.approx(correct / 24, abs=1e-7)}


class TokenTagger(nn.Module):
    """Scores every class at every position of a sequence: outputs (batch, positions, classes)."""

    def __init__(self, vocab: int = 10, classes: int = 3):
        super().__init__()
        self.embedding, self.head = nn.Embedding(vocab, 8), nn.Linear(8, classes)

    def forward(self, tokens):
        return self.head(self.embedding(tokens))


def test_named_metrics_on_token_logits_are_refused_with_what_to_do_instead():
    """Whether position t scores token t or t+1 (a causal LM) is the model's to say: a named metric would score
    the wrong pairs silently."""
    tokens = torch.randint(0, 10, (16, 5))
    model = easyfit.Model(TokenTagger(), loss=lambda out, target: F.cross_entropy(out.transpose(1, 2), target),
                          metrics=["accuracy"])
    with pytest.raises(ValueError, match=r"shape \(8, 5, 3\) for class targets of shape \(8, 5\).*token logits"):
        model.fit(tokens, tokens % 3, batch_size=8, verbose=0)
    images = torch.randn(4, 3, 3, 3)   # (N, C, H, W) with C == H == W: torchmetrics' own layout, still taken
    task = metrics_module.infer_task(images, torch.randint(0, 3, (4, 3, 3)), None)
    assert (task.name, task.classes) == ("multiclass", 3)
