"""Metrics by name, mapped to torchmetrics objects built on the first batch (task and classes inferred).

Metric states are synchronised through the strategy's gather (torchmetrics' `dist_sync_fn`), so the values are
exact on any number of processes, with or without a torch process group.
"""
from __future__ import annotations

import re
import warnings
from typing import Any, Callable

import torch

from easyfit.validation import closest_name


def _classification(metric_name: str, **extra) -> Callable:
    def build(task: str, num_classes: int):
        import torchmetrics
        cls = getattr(torchmetrics, metric_name)
        top_k = extra.get("top_k", 1)
        outputs = 1 if task == "binary" else num_classes
        if top_k > outputs:
            raise ValueError(f"top{top_k}_accuracy needs a net with at least {top_k} outputs (one per class); "
                             f"this one has {outputs}. Use 'accuracy' instead.")
        if task == "binary":
            return cls(task="binary", **extra)
        return cls(task="multiclass", num_classes=num_classes, **extra)
    return build


def _regression(metric_name: str, **extra) -> Callable:
    def build(task: str, num_classes: int):
        import torchmetrics
        return getattr(torchmetrics, metric_name)(**extra)
    return build


METRICS: dict[str, Callable] = {
    "accuracy": _classification("Accuracy"),
    "top5_accuracy": _classification("Accuracy", top_k=5),
    "top3_accuracy": _classification("Accuracy", top_k=3),
    "f1": _classification("F1Score", average="macro"),
    "precision": _classification("Precision", average="macro"),
    "recall": _classification("Recall", average="macro"),
    "auroc": _classification("AUROC", average="macro"),
    "mae": _regression("MeanAbsoluteError"),
    "mse": _regression("MeanSquaredError"),
    "rmse": _regression("MeanSquaredError", squared=False),
    "r2": _regression("R2Score"),
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


TASKS = ("binary", "multiclass")


def infer_task(output: torch.Tensor, target: torch.Tensor) -> tuple[str, int]:
    """("binary", 2) for one output per sample, else ("multiclass", number of output columns)."""
    if output.dim() >= 2 and output.shape[-1] > 1:
        return "multiclass", output.shape[-1]
    return "binary", 2


class MetricSet:
    """The metrics of a Model: names and torchmetrics objects, updated per batch, computed per epoch."""

    def __init__(self, metrics: Any):
        if metrics is None:
            metrics = []
        if isinstance(metrics, (str, torch.nn.Module)):
            metrics = [metrics]
        items = metrics.items() if isinstance(metrics, dict) else ((None, m) for m in metrics)
        self.pending: dict[str, str] = {}   # log name -> METRICS key, built on the first batch
        self.metrics: dict[str, Any] = {}   # log name -> torchmetrics.Metric
        for name, metric in items:
            if isinstance(metric, str):
                self.pending[name or metric] = metric_key(metric)
            elif hasattr(metric, "update") and hasattr(metric, "compute") and hasattr(metric, "reset"):
                self.metrics[name or snake_case(type(metric).__name__)] = metric
            else:
                raise TypeError(f"a metric must be a name or a torchmetrics.Metric; got {type(metric).__name__}")
        self.names = list(self.pending) + list(self.metrics)
        self.task: tuple[str, int] | None = None   # (task, num_classes) the named metrics were built for
        self.task_shared = not self.pending   # whether every rank has built the named metrics (see share_task)

    def __bool__(self) -> bool:
        return bool(self.names)

    def build(self, output: torch.Tensor, target: torch.Tensor) -> None:
        """Create the named metrics for this task, on the output's device (first batch only)."""
        self._build(infer_task(output, target), output.device)

    def _build(self, task: tuple[str, int], device: torch.device) -> None:
        self.task = task
        for name, key in self.pending.items():
            self.metrics[name] = METRICS[key](*task)
        self.pending = {}
        for metric in self.metrics.values():
            metric.to(device)

    def share_task(self, strategy) -> None:
        """Build the named metrics on a rank that saw no batch (e.g. an empty share of a tiny evaluation set) with
        the task another rank inferred, so that every rank computes, and so synchronises, the same metrics.
        Call it on every rank before the first multi-process `compute`: one collective, that first time only."""
        if self.task_shared:
            return
        task = torch.tensor([[TASKS.index(self.task[0]), self.task[1]]]) if self.task else torch.empty(0, 2)
        known = [part for part in strategy.all_gather(task.long().to(strategy.root_device)) if len(part)]
        if self.pending and known:
            task_index, num_classes = known[0][0].tolist()
            self._build((TASKS[task_index], num_classes), strategy.root_device)
        self.task_shared = True

    def update(self, output: torch.Tensor, target: torch.Tensor) -> None:
        if self.pending:
            self.build(output, target)
        output = output.detach()
        if output.dim() == target.dim() + 1 and output.shape[-1] == 1:
            output = output.squeeze(-1)
        for metric in self.metrics.values():
            metric.update(output, target)

    def compute(self, sync_fn: Callable | None = None) -> dict[str, float]:
        """Epoch values; with a `sync_fn` (the strategy's gather), over all processes, every rank taking part even
        if it saw no batch. Without it, the values stay local even while a process group is open."""
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

    def reset(self) -> None:
        for metric in self.metrics.values():
            metric.reset()


def _always() -> bool:
    return True


def _never() -> bool:
    return False
