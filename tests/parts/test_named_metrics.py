"""easyfit's own named metric objects give torchmetrics' numbers for the settings a name stands for, over drawn
tasks, shapes, batchings and process splits, and scikit-learn's on real data."""
from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from sklearn import datasets, metrics as sk

import easyfit
from easyfit.parts import named_metrics
from easyfit.parts.metrics import METRICS, MetricSet, Task

CLASSIFICATION = ("accuracy", "top3_accuracy", "f1", "precision", "recall", "auroc")
REGRESSION = ("mae", "mse", "rmse", "r2")


def torchmetrics_object(name: str, task: Task):
    """The torchmetrics object a name stood for before easyfit had its own (the test skips without torchmetrics)."""
    torchmetrics = pytest.importorskip("torchmetrics")
    if name in REGRESSION:
        return {"mae": torchmetrics.MeanAbsoluteError, "mse": torchmetrics.MeanSquaredError,
                "rmse": lambda: torchmetrics.MeanSquaredError(squared=False), "r2": torchmetrics.R2Score}[name]()
    cls = {"accuracy": torchmetrics.Accuracy, "top3_accuracy": torchmetrics.Accuracy, "f1": torchmetrics.F1Score,
           "precision": torchmetrics.Precision, "recall": torchmetrics.Recall, "auroc": torchmetrics.AUROC}[name]
    extra = {"top_k": 3} if name == "top3_accuracy" else ({} if name == "accuracy" else {"average": "macro"})
    if task.name == "binary":
        return cls(task="binary", **extra)
    if task.name == "multilabel":
        return cls(task="multilabel", num_labels=task.classes, **{"average": "micro", **extra})
    return cls(task="multiclass", num_classes=task.classes, **extra)


def draw_batches(rng: np.random.Generator, task: str) -> tuple[Task, list[tuple[torch.Tensor, torch.Tensor]]]:
    """Prepared batches (probabilities, targets) of one drawn task: sizes from 1 up, scores with ties, classes
    that never occur."""
    classes = int(rng.integers(3, 7)) if task != "binary" else 2
    positions = int(rng.integers(2, 4)) if task == "multiclass" and rng.random() < 0.3 else 0
    occurring = rng.choice(classes, size=max(1, classes - int(rng.integers(0, 2))), replace=False)
    batches = []
    for _ in range(int(rng.integers(1, 6))):
        n = int(rng.integers(1, 12))
        shape = (n, classes) + ((positions,) if positions else ())
        scores = torch.from_numpy(rng.random(shape)).float()
        if rng.random() < 0.5:
            scores = (scores * 4).round() / 4   # ties
        if task == "binary":
            output, target = scores[:, 0], torch.from_numpy(rng.integers(0, 2, n))
        elif task == "multilabel":
            output, target = scores, torch.from_numpy(rng.integers(0, 2, shape))
        else:
            output = scores.softmax(1)
            target = torch.from_numpy(rng.choice(occurring, size=(n,) + ((positions,) if positions else ())))
        batches.append((output, target))
    return Task(task, classes, "probabilities", False), batches


def split_over_ranks(metric_of, batches: list, ranks: int):
    """`ranks` metric objects, each given every `ranks`-th batch, the first one synchronised with the others as a
    process group would (its gather gets every rank's state, in rank order)."""
    objects = [metric_of() for _ in range(ranks)]
    for index, (output, target) in enumerate(batches):
        objects[index % ranks].update(output, target)
    if ranks > 1:
        first = objects[0]
        others = iter([[other._local(name) for other in objects[1:]] for name in first._reductions])
        first.dist_sync_fn = lambda tensor, group=None: [tensor, *next(others)]
        first.distributed_available_fn = lambda: True
    return objects[0]


def value(metric) -> float:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return float(metric.compute())


@pytest.mark.parametrize("seed", range(40))
def test_named_classification_metrics_equal_torchmetrics_over_drawn_batches(seed):
    rng = np.random.default_rng(seed)
    task, batches = draw_batches(rng, ("binary", "multiclass", "multilabel")[seed % 3])
    ranks = int(rng.integers(1, 4))
    for name in CLASSIFICATION:
        if name == "top3_accuracy" and task.name != "multiclass":
            continue
        ours = split_over_ranks(lambda name=name: METRICS[name](task), batches, ranks)
        theirs = torchmetrics_object(name, task)
        for output, target in batches:
            theirs.update(output, target)
        assert value(ours) == pytest.approx(value(theirs), abs=1e-6), (name, task, ranks)


@pytest.mark.parametrize("seed", range(12))
def test_named_regression_metrics_equal_torchmetrics_over_drawn_batches(seed):
    rng = np.random.default_rng(seed)
    columns = int(rng.integers(1, 4)) if seed % 2 else 0
    batches = [(torch.from_numpy(rng.normal(size=(n,) + ((columns,) if columns else ()))).float(),
                torch.from_numpy(rng.normal(size=(n,) + ((columns,) if columns else ()))).float())
               for n in rng.integers(2, 9, size=int(rng.integers(1, 5)))]
    for name in REGRESSION:
        ours = split_over_ranks(lambda name=name: METRICS[name](Task("regression", 0, "logits", False)), batches,
                                int(rng.integers(1, 4)))
        theirs = torchmetrics_object(name, Task("regression", 0, "logits", False))
        for output, target in batches:
            theirs.update(output, target)
        assert value(ours) == pytest.approx(value(theirs), rel=1e-5, abs=1e-6), name


#: each output kind with a loss that says so, by task
KIND_LOSSES = {"logits": {"binary": torch.nn.BCEWithLogitsLoss(), "multilabel": torch.nn.BCEWithLogitsLoss(),
                          "multiclass": torch.nn.CrossEntropyLoss()},
               "probabilities": {"binary": torch.nn.BCELoss(), "multilabel": torch.nn.BCELoss(),
                                 "multiclass": torch.nn.L1Loss()},
               "log_probabilities": {"multiclass": torch.nn.NLLLoss()}}


def draw_outputs(rng: np.random.Generator, task: str, kind: str, dtype: torch.dtype) -> list:
    """(output, target) batches of one drawn task as a net gives them in `dtype` (a mixed precision's bf16 or
    float16): logits at a drawn scale (down to a few thousandths, where a low-precision sigmoid rounds to 0.5), with
    ties; probabilities; or log-probabilities."""
    classes, scale, batches = (1 if task == "binary" else int(rng.integers(3, 7))), rng.choice((3e-3, 1.0, 8.0)), []
    for n in rng.integers(1, 40, size=int(rng.integers(1, 5))):
        logits = torch.from_numpy(rng.normal(size=(n, classes)) * scale)
        if rng.random() < 0.3:
            logits = (logits / scale * 2).round() * scale / 2   # ties
        output = {"logits": logits, "probabilities": logits.sigmoid() if task != "multiclass" else logits.softmax(1),
                  "log_probabilities": logits.log_softmax(1)}[kind].to(dtype)
        target = (torch.from_numpy(rng.integers(0, classes, n)) if task == "multiclass"
                  else torch.from_numpy(rng.integers(0, 2, (n, classes))).float())
        batches.append((output, target))
    return batches


def exact_probabilities(output: torch.Tensor, kind: str, task: str, name: str) -> torch.Tensor:
    """The probabilities the outputs stand for, in float64: no rounding moves one to the other side of 0.5 or ties
    two of them. Multiclass auroc's ranking of one class's softmax over the samples is the float32 softmax's, as
    documented: in float64 as in float32, rounding breaks some true ties of such probabilities, each its own way."""
    if name == "auroc" and kind == "logits" and task == "multiclass":
        return output.float().softmax(1)
    output = output.double()
    if kind == "logits":
        return output.softmax(1) if task == "multiclass" else output.sigmoid()
    return output.exp() if kind == "log_probabilities" else output


@pytest.mark.parametrize("seed", range(18))
def test_metrics_of_low_precision_outputs_equal_torchmetrics_on_their_exact_probabilities(seed):
    """The mixed precisions' dimension of the drawn comparison: outputs in bf16 / float16 (or float32), of every
    kind, read by a MetricSet as a fit reads them, with and without auroc, against torchmetrics given the float64
    probabilities of the same outputs."""
    rng = np.random.default_rng(1000 + seed)
    task = ("binary", "multiclass", "multilabel")[seed % 3]
    kind = rng.choice([kind for kind, losses in KIND_LOSSES.items() if task in losses])
    dtype = (torch.bfloat16, torch.float16, torch.float32)[(seed // 3) % 3]
    batches = draw_outputs(rng, task, kind, dtype)
    names = [name for name in CLASSIFICATION if name != "top3_accuracy" or task == "multiclass"]
    for given in (names, [name for name in names if name != "auroc"]):
        metrics = MetricSet(given, KIND_LOSSES[kind][task])
        for output, target in batches:
            metrics.update(output, target)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            values = metrics.compute()
        for name in given:
            theirs = torchmetrics_object(name, metrics.task)
            for output, target in batches:
                probabilities = exact_probabilities(output, kind, task, name)
                theirs.update(*((probabilities.squeeze(1), target.squeeze(1).long()) if task == "binary"
                                else (probabilities, target.long())))
            assert values[name] == pytest.approx(value(theirs), abs=1e-6), (name, task, kind, dtype, given)


def test_scores_per_position_with_the_classes_on_dimension_1_are_a_task_of_those_classes():
    """(samples, classes, positions) logits with (samples, positions) class targets, as torchmetrics takes them: the
    classes are dimension 1's (not the positions), and auroc's softmax runs over them."""
    torchmetrics = pytest.importorskip("torchmetrics")
    generator = torch.Generator().manual_seed(0)
    output, target = torch.randn(16, 3, 5, generator=generator), torch.randint(0, 3, (16, 5), generator=generator)
    metrics = MetricSet(["accuracy", "f1", "auroc"], torch.nn.CrossEntropyLoss())
    metrics.update(output, target)
    expected = {"accuracy": torchmetrics.functional.accuracy(output, target, "multiclass", num_classes=3),
                "f1": torchmetrics.functional.f1_score(output, target, "multiclass", num_classes=3, average="macro"),
                "auroc": torchmetrics.functional.auroc(output.softmax(1), target, "multiclass", num_classes=3)}
    assert metrics.task.classes == 3
    assert metrics.compute() == pytest.approx({name: float(value) for name, value in expected.items()}, abs=1e-6)


class Given(torch.nn.Module):
    """A net that outputs its input: the scores of a model fitted elsewhere."""

    def __init__(self):
        super().__init__()
        self.unused = torch.nn.Parameter(torch.zeros(()))

    def forward(self, x):
        return x


def test_named_metrics_equal_scikit_learn_on_real_data():
    """Digits (10 classes) and breast cancer (binary) with a fitted linear model's scores; diabetes for regression."""
    from sklearn.linear_model import LinearRegression, LogisticRegression
    digits = datasets.load_digits()
    scores = LogisticRegression(max_iter=200).fit(digits.data[:1000], digits.target[:1000]).predict_proba(
        digits.data[1000:])
    target = digits.target[1000:]
    model = easyfit.Model(Given(), "nll",
                          metrics=["accuracy", "top3_accuracy", "f1", "precision", "recall", "auroc"])
    got = model.evaluate(torch.tensor(scores).log().float(), torch.tensor(target), batch_size=97, verbose=0,
                         return_dict=True)
    predicted = scores.argmax(1)
    assert got["accuracy"] == pytest.approx(sk.accuracy_score(target, predicted), abs=1e-6)
    assert got["top3_accuracy"] == pytest.approx(sk.top_k_accuracy_score(target, scores, k=3), abs=1e-6)
    assert got["f1"] == pytest.approx(sk.f1_score(target, predicted, average="macro"), abs=1e-6)
    assert got["precision"] == pytest.approx(sk.precision_score(target, predicted, average="macro"), abs=1e-6)
    assert got["recall"] == pytest.approx(sk.recall_score(target, predicted, average="macro"), abs=1e-6)
    assert got["auroc"] == pytest.approx(sk.roc_auc_score(target, scores, multi_class="ovr"), abs=1e-6)

    cancer = datasets.load_breast_cancer()
    x = (cancer.data - cancer.data.mean(0)) / cancer.data.std(0)
    probability = LogisticRegression().fit(x[:400], cancer.target[:400]).predict_proba(x[400:])[:, 1]
    target = cancer.target[400:]
    model = easyfit.Model(Given(), "bce", metrics=["accuracy", "f1", "precision", "recall", "auroc"])
    got = model.evaluate(torch.tensor(probability).float()[:, None], torch.tensor(target).float()[:, None],
                         batch_size=31, verbose=0, return_dict=True)
    decided = probability > 0.5
    assert got["accuracy"] == pytest.approx(sk.accuracy_score(target, decided), abs=1e-6)
    assert got["f1"] == pytest.approx(sk.f1_score(target, decided), abs=1e-6)
    assert got["precision"] == pytest.approx(sk.precision_score(target, decided), abs=1e-6)
    assert got["recall"] == pytest.approx(sk.recall_score(target, decided), abs=1e-6)
    assert got["auroc"] == pytest.approx(sk.roc_auc_score(target, probability), abs=1e-6)

    diabetes = datasets.load_diabetes()
    predicted = LinearRegression().fit(diabetes.data[:300], diabetes.target[:300]).predict(diabetes.data[300:])
    target = diabetes.target[300:]
    model = easyfit.Model(Given(), "mse", metrics=["mae", "mse", "rmse", "r2"])
    got = model.evaluate(torch.tensor(predicted).float(), torch.tensor(target).float(), batch_size=29, verbose=0,
                         return_dict=True)
    assert got["mae"] == pytest.approx(sk.mean_absolute_error(target, predicted), rel=1e-5)
    assert got["mse"] == pytest.approx(sk.mean_squared_error(target, predicted), rel=1e-5)
    assert got["rmse"] == pytest.approx(sk.mean_squared_error(target, predicted) ** 0.5, rel=1e-5)
    assert got["r2"] == pytest.approx(sk.r2_score(target, predicted), abs=1e-5)


def test_a_fit_with_named_metrics_imports_no_torchmetrics():
    """A new process's first fit with every named metric: torchmetrics (about 3.5 s to import) stays out."""
    import subprocess
    import sys
    code = ("import sys, torch, easyfit\n"
            "x, y = torch.randn(64, 5), torch.randint(0, 3, (64,))\n"
            "model = easyfit.Model(torch.nn.Linear(5, 3), 'cross_entropy', 'sgd', metrics=['accuracy', 'f1', "
            "'precision', 'recall', 'auroc', 'top3_accuracy'])\n"
            "model.fit(x, y, epochs=1, batch_size=16, verbose=0, validation_split=0.25)\n"
            "print('torchmetrics' in sys.modules)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "False"


def test_wrong_targets_are_refused_with_what_to_do():
    accuracy = named_metrics.Accuracy("multiclass", 3)
    with pytest.raises(ValueError, match="targets hold class 3, but the net gives 3 class scores"):
        accuracy.update(torch.rand(4, 3), torch.tensor([0, 1, 2, 3]))
    with pytest.raises(ValueError, match="need 0/1 labels here; 1 targets are not, such as 2"):
        named_metrics.ClassCounts("f1", "binary", 2).update(torch.rand(4), torch.tensor([0, 1, 2, 1]))
    with pytest.raises(ValueError, match="class indices as targets; .* such as 1.5"):
        named_metrics.Accuracy("multiclass", 3).update(torch.rand(2, 3), torch.tensor([0.0, 1.5]))
    with pytest.raises(ValueError, match="r2 needs at least two samples; got 1"):
        r2 = named_metrics.R2()
        r2.update(torch.zeros(1), torch.ones(1))
        r2.compute()


class HostReads(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the reads of a tensor's value to the host (`item()`, `int()`, `bool()`): each waits for an
    accelerator's queue, and costs an XLA device a transfer."""

    def __init__(self):
        super().__init__()
        self.reads = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.reads += func is torch.ops.aten._local_scalar_dense.default
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("make, preds, wrong", [
    (lambda: named_metrics.Accuracy("multiclass", 3), lambda: torch.rand(4, 3), torch.tensor([0, 1, 7, 2])),
    (lambda: named_metrics.ClassCounts("f1", "multiclass", 3), lambda: torch.rand(4, 3), torch.tensor([0, -1, 2, 2])),
    (lambda: named_metrics.AUROC("multilabel", 2), lambda: torch.rand(4, 2), torch.tensor([[0, 1]] * 3 + [[1, 3]])),
    (lambda: named_metrics.ClassCounts("recall", "binary", 2), lambda: torch.rand(4), torch.tensor([0, 1, 1, 5])),
], ids=["accuracy", "f1", "auroc-multilabel", "recall-binary"])
@pytest.mark.filterwarnings("ignore:auroc. no")
def test_later_batches_are_taken_without_reading_the_device_and_their_wrong_targets_refused_with_the_value(
        make, preds, wrong):
    """Only the first batch's targets are read at once; a later batch's wrong targets are refused when the value is
    read, in the same read; a wrong class never reaches a one-hot encoding (a device-side assert on a GPU)."""
    metric = make()
    right = wrong.clamp(0, 1)
    metric.update(preds(), right)
    reads = HostReads()
    with reads:
        for _ in range(3):
            metric.update(preds(), right)
        metric.update(preds(), wrong)
    assert reads.reads == 0
    with pytest.raises(ValueError, match=r"class (7|-1), but|such as (3|5)\b"):
        metric.compute()
    metric.reset()
    metric.update(preds(), right)
    assert 0 <= float(metric.compute()) <= 1


def test_a_checkpoint_s_metric_state_of_another_kind_is_named_not_loaded():
    """A mid-epoch state saved by another metric object under the same name (e.g. an easyfit version whose named
    metrics were torchmetrics objects) is not put into this one: the resume names the metric as counting only the
    batches after it."""
    from easyfit.parts import metric_state
    from easyfit.parts.metrics import MetricSet
    metrics = MetricSet(["accuracy"], torch.nn.CrossEntropyLoss())
    metrics.update(torch.randn(4, 3), torch.tensor([0, 1, 2, 1]))
    saved = [{"task": list(metrics.task), "metrics": {"accuracy": {"updates": 1, "states": {
        "tp": torch.tensor(3), "fp": torch.tensor(1), "tn": torch.tensor(7), "fn": torch.tensor(1)}}}}]
    assert metric_state.restore(metrics, saved, rank=0, world_size=1, device="cpu") == ["accuracy"]
    assert not metrics.metrics["accuracy"].update_called
    assert metric_state.restore(metrics, saved + saved, rank=0, world_size=1, device="cpu") == ["accuracy"]
