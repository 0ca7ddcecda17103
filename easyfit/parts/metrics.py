"""Metrics by name, built on the first batch as easyfit's own metric objects (`named_metrics`: task and classes
inferred), and the user's torchmetrics objects beside them.

Metric states are synchronised through the strategy's gather (the metric's `dist_sync_fn`), so the values are
exact on any number of processes, with or without a torch process group.
"""
from __future__ import annotations

import math
import re
import warnings
from typing import Any, Callable, NamedTuple

import torch

from easyfit.parts import named_metrics
from easyfit.parts.losses import BINARY_LOSSES, CLASS_INDEX_LOSSES, OUTPUTS, output_kind
from easyfit.parts.outputs import prediction
from easyfit.utils.checks import closest_name

#: the named metrics take up to this many batches (and this many output elements) in one update: a metric
#: update costs tens of microseconds however small the batch, more than a small net's whole step
WAIT_BATCHES, WAIT_ELEMENTS = 16, 1 << 20


class Task(NamedTuple):
    """What the classification metrics were built for, and how each batch is brought to their form."""
    name: str              # "binary", "multiclass", "multilabel", or "regression" (no classification metric)
    classes: int           # classes (multiclass) or labels (multilabel); 2 for binary
    outputs: str           # what the net's outputs are: one of OUTPUTS
    one_hot_targets: bool  # multiclass targets given as one value per class (one-hot or probabilities): argmax

    @property
    def threshold(self) -> float:
        """The output that stands for a probability of 0.5: a binary or multilabel output above it decides 1."""
        return {"logits": 0.0, "log_probabilities": math.log(0.5)}.get(self.outputs, 0.5)

    def prepare(self, output: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Scores and class targets. The scores are the outputs in float32 or wider, whatever the precision (values
        given as probabilities clamped to [0, 1]): they rank classes and samples and fall on either side of
        `threshold` as the probabilities do, so no metric guesses whether they are logits, and no sigmoid or softmax
        rounds two outputs to one probability."""
        if output.is_floating_point() and output.dtype.itemsize < 4:
            output = output.float()
        if self.outputs == "probabilities":
            output = output.clamp(0, 1)
        if self.one_hot_targets:
            target = target.argmax(-1)
        elif self.name == "multilabel":
            target = (target >= 0.5).long()
        return output, target

    def probabilities(self, scores: torch.Tensor) -> torch.Tensor:
        """Scores (`prepare`'s) that rank the samples of each class as its probabilities do: a multiclass task's
        logits become probabilities (softmax over the classes, dimension 1); other scores already do (sigmoid and
        exp keep their order)."""
        return scores.softmax(1) if self.name == "multiclass" and self.outputs == "logits" else scores


def _classification(build_metric: Callable, probabilities: bool = False, top_k: int = 1) -> Callable:
    def build(task: Task):
        if top_k > 1 and task.name != "multiclass":
            raise ValueError(f"top{top_k}_accuracy needs a multiclass task (one output per class and class "
                             f"targets); this is a {task.name} task with {task.classes if task.name != 'binary' else 1}"
                             " output column(s). Use 'accuracy' instead.")
        if top_k > task.classes:
            raise ValueError(f"top{top_k}_accuracy needs a net with at least {top_k} outputs (one per class); "
                             f"this one has {task.classes}. Use 'accuracy' instead.")
        return build_metric(task)
    build.classification = True
    build.probabilities = probabilities   # whether it reads probabilities, not only the classes ranked first
    return build


def _regression(build_metric: Callable) -> Callable:
    def build(task: Task):
        return build_metric()
    build.classification = False
    return build


def _accuracy(top_k: int) -> Callable:
    return _classification(lambda task: named_metrics.Accuracy(task.name, task.classes, top_k, task.threshold),
                           top_k=top_k)


def _class_counts(score: str) -> Callable:
    return _classification(lambda task: named_metrics.ClassCounts(score, task.name, task.classes, task.threshold))


METRICS: dict[str, Callable] = {
    "accuracy": _accuracy(1),
    "top5_accuracy": _accuracy(5),
    "top3_accuracy": _accuracy(3),
    "f1": _class_counts("f1"),
    "precision": _class_counts("precision"),
    "recall": _class_counts("recall"),
    "auroc": _classification(lambda task: named_metrics.AUROC(task.name, task.classes), probabilities=True),
    "mae": _regression(lambda: named_metrics.MeanError(squared=False)),
    "mse": _regression(lambda: named_metrics.MeanError(squared=True)),
    "rmse": _regression(lambda: named_metrics.MeanError(squared=True, root=True)),
    "r2": _regression(named_metrics.R2),
}
ALIASES = {"acc": "accuracy", "top_5_accuracy": "top5_accuracy", "f1_score": "f1", "auc": "auroc",
           "mean_absolute_error": "mae", "mean_squared_error": "mse"}


def metric_key(name: str) -> str:
    key = ALIASES.get(name.lower(), name.lower())
    if key not in METRICS:
        raise ValueError(f"unknown metric {name!r}.{closest_name(key, list(METRICS) + list(ALIASES))} "
                         f"Valid names: {', '.join(sorted(METRICS))}; or pass a torchmetrics.Metric object.")
    return key


def metric_names(metrics: Any) -> list[str] | dict[str, str]:
    """The metrics given by name, as given (a list, or a dict of log name -> name): to rebuild them on load."""
    if isinstance(metrics, dict):
        return {name: metric for name, metric in metrics.items() if isinstance(metric, str)}
    return [m for m in ([metrics] if isinstance(metrics, str) else metrics or []) if isinstance(m, str)]


def snake_case(name: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()


TASKS = ("binary", "multiclass", "multilabel", "regression")


def infer_task(output: torch.Tensor, target: torch.Tensor, loss_fn: Any) -> Task:
    """The classification task from the outputs, the targets and the loss (see docs/api.md, "Metric names")."""
    outputs = output_kind(loss_fn) or ("probabilities" if _within_unit_interval(output) else "logits")
    if output.dim() < 2 or output.shape[-1] == 1:
        return Task("binary", 2, outputs, False)
    classes_second = target.shape == output.shape[:1] + output.shape[2:]   # (N, C, ...) as torchmetrics takes
    columns = output.shape[1] if classes_second else output.shape[-1]
    if output.dim() > 2 and target.shape == output.shape[:-1] and not classes_second:
        raise ValueError(
            f"the classification metrics got outputs of shape {tuple(output.shape)} for class targets of shape "
            f"{tuple(target.shape)}: one score per class for every position (a sequence model's token logits). "
            "easyfit does not guess how such positions are scored: a causal language model's logits at position t "
            "predict token t+1 (its own loss shifts them), a tagger's predict token t, and padded positions must "
            "be skipped. Pass a torchmetrics object that takes your layout (e.g. "
            "torchmetrics.Accuracy(task='multiclass', num_classes=..., ignore_index=-100) on logits moved to "
            "(batch, classes, positions) by a wrapper net), or track the loss alone ('loss', 'val_loss').")
    if target.shape != output.shape:   # class indices
        return Task("multiclass", columns, outputs, False)
    if isinstance(loss_fn, CLASS_INDEX_LOSSES):   # class probabilities (one-hot or soft) as targets
        return Task("multiclass", columns, outputs, True)
    binary_values = bool(((target == 0) | (target == 1)).all())
    if isinstance(loss_fn, BINARY_LOSSES) or (binary_values and not bool((target.sum(-1) == 1).all())):
        return Task("multilabel", columns, outputs, False)
    if binary_values or bool((target >= 0).all() & (target.sum(-1) - 1).abs().lt(1e-4).all()):
        return Task("multiclass", columns, outputs, True)
    raise ValueError(f"classification metrics need class targets: class indices, one-hot rows or 0/1 labels; "
                     f"got {target.dtype} targets of shape {tuple(target.shape)} that are none of these. "
                     "Use regression metrics ('mae', 'mse', 'r2') for these targets.")


def _within_unit_interval(output: torch.Tensor) -> bool:
    return bool(((output >= 0) & (output <= 1)).all())


class MetricSet:
    """The metrics of a Model: names and metric objects, updated per batch, computed per epoch."""

    def __init__(self, metrics: Any, loss_fn: Any = None):
        self.loss_fn = loss_fn   # tells whether the outputs are logits or probabilities, and the task
        if metrics is None:
            metrics = []
        if isinstance(metrics, (str, torch.nn.Module)):
            metrics = [metrics]
        items = metrics.items() if isinstance(metrics, dict) else ((None, m) for m in metrics)
        self.pending: dict[str, str] = {}   # log name -> METRICS key, built on the first batch
        self.metrics: dict[str, Any] = {}   # log name -> a metric object (named_metrics, or the user's)
        self.names: list[str] = []   # log names in the order the metrics were given
        for name, metric in items:
            if isinstance(metric, str):
                name = name or metric
                self.pending[name] = metric_key(metric)
            elif hasattr(metric, "update") and hasattr(metric, "compute") and hasattr(metric, "reset"):
                name = name or snake_case(type(metric).__name__)
                self.metrics[name] = metric
            else:
                raise TypeError(f"a metric must be a name or a torchmetrics.Metric; got {type(metric).__name__}")
            self.names.append(name)
        self.task: Task | None = None   # what the named metrics were built for
        self.classified: list[Any] = []   # named classification metrics: they get Task.prepare's form
        self.ranking: list[Any] = []   # those of them that rank by probabilities (Task.probabilities)
        self.own: list[Any] = list(self.metrics.values())   # the user's metric objects: outputs as they are, each batch
        self.named_raw: list[Any] = []   # named regression metrics: outputs as they are
        self.waiting: list[tuple[torch.Tensor, torch.Tensor]] = []   # batches the named metrics have yet to take
        self.waiting_elements = 0
        self.task_shared = not self.pending   # whether every rank has built the named metrics (see share_task)

    def __bool__(self) -> bool:
        return bool(self.names)

    def build(self, output: torch.Tensor, target: torch.Tensor) -> None:
        """Create the named metrics for this task, on the output's device (first batch only)."""
        output = prediction(output)
        classification = [name for name, key in self.pending.items() if METRICS[key].classification]
        task = infer_task(output, target, self.loss_fn) if classification else Task("regression", 0, OUTPUTS[0], False)
        if task.name == "binary" and target.numel() and not bool(((target == 0) | (target == 1)).all()):
            value = target[(target != 0) & (target != 1)].flatten()[0].item()
            raise ValueError(f"the classification metrics {', '.join(map(repr, classification))} need 0/1 labels as "
                             "targets of a one-column output, but the targets hold "
                             f"{str(target.dtype).replace('torch.', '')} values such as {value:.4g}: a regression "
                             "task? Use regression metrics ('mae', 'mse', 'rmse', 'r2') for such targets, or give "
                             "class targets: 0/1 labels, or class indices with one output per class.")
        self._build(task, output.device)

    def _build(self, task: Task, device: torch.device) -> None:
        self.task = task
        for name, key in self.pending.items():
            self.metrics[name] = METRICS[key](task)
            (self.classified if METRICS[key].classification else self.named_raw).append(self.metrics[name])
            if getattr(METRICS[key], "probabilities", False):
                self.ranking.append(self.metrics[name])
        self.pending = {}
        for metric in self.metrics.values():
            metric.to(device)

    def share_task(self, strategy) -> None:
        """Build the named metrics on a rank that saw no batch (e.g. an empty share of a tiny evaluation set) with
        the task another rank inferred, so that every rank computes, and so synchronises, the same metrics.
        Call it on every rank before the first multi-process `compute`: one collective, that first time only."""
        if self.task_shared:
            return
        task = self.task
        device = strategy.root_device
        encoded = (torch.tensor([[TASKS.index(task.name), task.classes, OUTPUTS.index(task.outputs),
                                  task.one_hot_targets]], dtype=torch.long, device=device) if task
                   else torch.empty(0, 4, dtype=torch.long, device=device))
        known = [part for part in strategy.all_gather(encoded) if len(part)]
        if self.pending and known:
            name, classes, outputs, one_hot = known[0][0].tolist()
            self._build(Task(TASKS[name], classes, OUTPUTS[outputs], bool(one_hot)), strategy.root_device)
        self.task_shared = True

    def update(self, output: torch.Tensor, target: torch.Tensor) -> None:
        """Take a batch: the user's own metric objects at once; easyfit's named metrics, whose states add up over
        samples, with the batches after it in one update (`flush`), except the first, whose errors show in its step.
        A structured output (a ModelOutput, a dict) gives its prediction (easyfit.parts.outputs)."""
        output = prediction(output)
        if self.pending:
            self.build(output, target)
            self._update(output, target, self.own + self.named_raw, self.classified)
            return
        if self.own:
            self._update(output, target, self.own, [])
        if not (self.named_raw or self.classified):
            return
        # taken at once where waiting does not pay: on an XLA device (each new length of joined batches would compile
        # another graph), and a batch of WAIT_ELEMENTS outputs or more (its copy would only cost memory)
        if not (isinstance(output, torch.Tensor) and isinstance(target, torch.Tensor)) or output.device.type == "xla" \
                or output.numel() >= WAIT_ELEMENTS:
            self.flush()
            self._update(output, target, self.named_raw, self.classified)
            return
        if self.waiting and not _joinable(self.waiting[-1], output, target):
            self.flush()
        # copies: a CUDA graph's next replay overwrites its outputs, and a loader may reuse its batch buffers
        self.waiting.append((output.detach().clone(), target.clone()))
        self.waiting_elements += output.numel()
        if len(self.waiting) >= WAIT_BATCHES or self.waiting_elements >= WAIT_ELEMENTS:
            self.flush()

    def flush(self) -> None:
        """Give the named metrics the batches they have yet to take, as one batch."""
        if not self.waiting:
            return
        outputs, targets = zip(*self.waiting)
        self.waiting, self.waiting_elements = [], 0
        self._update(torch.cat(outputs), torch.cat(targets), self.named_raw, self.classified)

    def _update(self, output: torch.Tensor, target: torch.Tensor, raw: list, classified: list) -> None:
        output = output.detach()
        if output.dim() == target.dim() + 1 and output.shape[-1] == 1:
            output = output.squeeze(-1)
        for metric in raw:
            metric.update(output, target)
        if classified:
            scores, target = self.task.prepare(output, target)
            probabilities = self.task.probabilities(scores) if self.ranking else scores
            for metric in classified:
                metric.update(probabilities if metric in self.ranking else scores, target)

    def compute(self, sync_fn: Callable | None = None) -> dict[str, float]:
        """Epoch values; with a `sync_fn` (the strategy's gather), over all processes, every rank taking part even
        if it saw no batch. Without it, the values stay local even while a process group is open."""
        self.flush()
        values = {}
        for name, metric in self.metrics.items():
            if sync_fn is not None or metric.update_called:
                metric.dist_sync_fn = sync_fn
                metric.distributed_available_fn = _always if sync_fn is not None else _never
                with warnings.catch_warnings():
                    if not metric.update_called:   # this rank saw no batch, the others did: not worth a warning
                        warnings.simplefilter("ignore")
                    values[name] = float(metric.compute())
        return values

    def running_names(self) -> list[str]:
        """The metrics that have a running value (`running`): those that took a batch this epoch, or have one
        waiting."""
        waiting = {id(metric) for metric in self.classified + self.named_raw} if self.waiting else set()
        return [name for name in self.names
                if name in self.metrics and (self.metrics[name].update_called or id(self.metrics[name]) in waiting)]

    def running(self, name: str) -> float | None:
        """Metric `name` over this process's batches so far (batch logs read it: the waiting batches are taken
        then, and nothing is synchronised); None when it has no value yet."""
        metric = self.metrics.get(name)
        if metric is None:
            return None
        self.flush()
        if not metric.update_called:
            return None
        available = metric.distributed_available_fn
        metric.distributed_available_fn = _never
        try:
            return float(metric.compute())
        finally:   # a metric keeps its computed value until the next update: the epoch's own compute must sync
            metric.distributed_available_fn, metric._computed = available, None

    def reset(self) -> None:
        self.waiting, self.waiting_elements = [], 0
        for metric in self.metrics.values():
            metric.reset()


def _joinable(waiting: tuple[torch.Tensor, torch.Tensor], output: torch.Tensor, target: torch.Tensor) -> bool:
    """Whether a batch concatenates with a waiting one (the same shapes but for the batch dimension)."""
    return all(new.shape[1:] == old.shape[1:] and new.dtype == old.dtype and new.device == old.device
               for new, old in zip((output, target), waiting))


def _always() -> bool:
    return True


def _never() -> bool:
    return False
