"""easyfit's own metric objects behind the metric names: exact on any number of processes, and cheap to start.

Each keeps a few tensors that add up over batches (counts, sums) or are joined (AUROC's scores), so a value over
several processes is the value over their joined batches. They take the metric-object protocol easyfit uses for
torchmetrics objects too (`update`, `compute`, `reset`, `update_called`, `dist_sync_fn`, the states in
`metric_state` and how each is reduced in `_reductions`), and give torchmetrics' numbers for the same settings
(`tests/parts/test_named_metrics.py` checks both against each other and against scikit-learn). Building them
imports nothing: importing torchmetrics costs a new process about 3.5 s.
"""
from __future__ import annotations

import math
import warnings
from typing import Callable

import torch

#: how a state is brought together over batches and processes: added up, or joined along its first dimension
SUM, CAT = "sum", "cat"


class NamedMetric:
    """A metric whose state is a few tensors, each added up (SUM) or joined (CAT) over batches and processes."""

    #: state name -> SUM or CAT
    _reductions: dict[str, str] = {}

    def __init__(self) -> None:
        self.device = torch.device("cpu")
        self.dist_sync_fn: Callable | None = None   # the strategy's gather: a tensor -> every rank's tensor
        self.distributed_available_fn: Callable[[], bool] = _never
        self.reset()

    def reset(self) -> None:
        for name, reduction in self._reductions.items():
            setattr(self, name, [] if reduction == CAT else torch.zeros(self._shape(name), dtype=self._dtype(name),
                                                                         device=self.device))
        self._update_count = 0
        self._computed: torch.Tensor | None = None

    @property
    def update_called(self) -> bool:
        return self._update_count > 0

    @property
    def metric_state(self) -> dict:
        return {name: getattr(self, name) for name in self._reductions}

    def to(self, device) -> NamedMetric:
        self.device = torch.device(device)
        for name, value in self.metric_state.items():
            setattr(self, name, [part.to(device) for part in value] if isinstance(value, list) else value.to(device))
        return self

    def update(self, preds: torch.Tensor, target: torch.Tensor) -> None:
        for name, value in self._batch_state(preds, target).items():
            state = getattr(self, name)
            if isinstance(state, list):
                state.append(value)
            else:   # not in place: R2's one-element states become one per output column at a 2-D target
                setattr(self, name, state + value)
        self._update_count += 1
        self._computed = None

    def compute(self) -> torch.Tensor:
        """The value over this process's batches, or over every process's when a process group is there."""
        if self._computed is None:
            self._computed = self._value(**self._joined())
        return self._computed

    def _joined(self) -> dict[str, torch.Tensor]:
        states = {name: self._local(name) for name in self._reductions}
        if self.dist_sync_fn is None or not self.distributed_available_fn():
            return states
        return {name: (torch.cat if self._reductions[name] == CAT else _added)(self.dist_sync_fn(value))
                for name, value in states.items()}

    def _local(self, name: str) -> torch.Tensor:
        value = getattr(self, name)
        if not isinstance(value, list):
            return value
        return torch.cat(value) if value else torch.zeros(self._shape(name), dtype=self._dtype(name),
                                                          device=self.device)

    # what a metric defines
    def _shape(self, name: str) -> tuple[int, ...]:
        """A SUM state's shape; a CAT state's shape when empty."""
        return ()

    def _dtype(self, name: str) -> torch.dtype:
        return torch.long

    def _batch_state(self, preds: torch.Tensor, target: torch.Tensor) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def _value(self, **states: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


def _added(parts: list[torch.Tensor]) -> torch.Tensor:
    """The sum of every rank's state; a rank that saw no batch holds a state of one element (see R2)."""
    return torch.stack(torch.broadcast_tensors(*parts)).sum(0)


def _never() -> bool:
    return False


def _count(number: int, like: torch.Tensor) -> torch.Tensor:
    """A count as a tensor on `like`'s device, filled there: no copy from the host, which would wait for the device."""
    return torch.full((), number, dtype=torch.long, device=like.device)


def _ratio(numerator: torch.Tensor, denominator: torch.Tensor) -> torch.Tensor:
    """numerator / denominator, 0 where the denominator is 0 (a class never predicted has precision 0); in float32,
    which every device has."""
    numerator, denominator = numerator.float(), denominator.float()
    return torch.where(denominator == 0, torch.zeros_like(numerator), numerator / denominator.clamp_min(1))


# ---- classification: what each batch is brought to -------------------------------------------------------------

class Classified(NamedMetric):
    """A classification metric for one task: "binary" (probabilities of the positive class), "multiclass" (one score
    per class on dimension 1, class indices as targets) or "multilabel" (a probability per label, 0/1 targets)."""

    def __init__(self, task: str, classes: int) -> None:
        self.task, self.classes = task, classes
        self._first_batch_read = False
        super().__init__()

    def _flat(self, preds: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The scores and the targets: (samples, classes) scores and flat class indices (multiclass), (samples,
        labels) scores and 0/1 targets (multilabel), or flat (binary). Shapes are checked here; the targets' values
        are noted by `_note_wrong_targets`."""
        self._note_wrong_targets(target)
        if self.task == "multiclass":
            scores = preds.movedim(1, -1).reshape(-1, preds.shape[1]) if preds.dim() > 2 else preds
            target = target.reshape(-1)
            if scores.shape[0] != target.shape[0]:
                raise ValueError(f"the classification metrics got {scores.shape[0]} rows of class scores for "
                                 f"{target.shape[0]} targets: give one row of {self.classes} scores per target.")
        else:
            _check_same_shape(preds, target, "classification")
        if self.task == "multilabel":
            return preds.movedim(1, -1).reshape(-1, self.classes), target.movedim(1, -1).reshape(-1, self.classes)
        return (scores, target) if self.task == "multiclass" else (preds.reshape(-1), target.reshape(-1))

    def _note_wrong_targets(self, target: torch.Tensor) -> None:
        """Keep, on the device, how many targets this task cannot take and the largest of them: reading them after
        every batch would stop an accelerator's queue (and cost an XLA device a transfer) each time. They are read
        with the value; the fit's first batch is also checked at once, from a copy on the host, so that its error
        shows in its own step."""
        if not target.numel():
            return
        if not self._first_batch_read:
            self._first_batch_read = True
            self._refuse_wrong_targets(self._wrong_targets_of(target.cpu()).tolist())
        wrong_targets = self._wrong_targets_of(target)
        self._wrong_targets = torch.stack([self._wrong_targets[0] + wrong_targets[0],
                                           torch.maximum(self._wrong_targets[1], wrong_targets[1])])

    def _wrong_targets_of(self, target: torch.Tensor) -> torch.Tensor:
        """How many targets the task cannot take, and the largest of them (-inf without any)."""
        if self.task == "multiclass":
            wrong = (target < 0) | (target >= self.classes)
            if target.is_floating_point():
                wrong |= target != target.round()
        else:
            wrong = (target != 0) & (target != 1)
        return torch.stack([wrong.sum().float(), target.float().masked_fill(~wrong, float("-inf")).max()])

    def _refuse_wrong_targets(self, wrong_targets: list[float]) -> None:
        count, largest = wrong_targets
        if not count:
            return
        if self.task != "multiclass":
            raise ValueError(f"the classification metrics need 0/1 labels here; {count:.0f} targets are not, such as "
                             f"{largest:.4g}. Give 0/1 labels, or use regression metrics ('mae', 'mse', 'rmse', "
                             "'r2').")
        if not math.isfinite(largest) or largest != round(largest):
            raise ValueError("the classification metrics need class indices as targets; got values that are not "
                             f"whole numbers, such as {largest:.4g}. Give class indices (a long tensor).")
        raise ValueError(f"the targets hold class {largest:.0f}, but the net gives {self.classes} class scores "
                         f"(classes 0 to {self.classes - 1}). Give the net one output per class, or check the labels.")

    def reset(self) -> None:
        super().reset()
        # (how many, the largest) since the reset, on the device
        self._wrong_targets = torch.tensor([0.0, float("-inf")], device=self.device)

    def to(self, device) -> Classified:
        super().to(device)
        self._wrong_targets = self._wrong_targets.to(device)
        return self

    def compute(self) -> torch.Tensor:
        """The value, after the targets' values are checked: both in one read from the device."""
        if self._computed is None:
            *wrong_targets, value = torch.cat([self._wrong_targets, super().compute().float().reshape(1)]).tolist()
            self._refuse_wrong_targets(wrong_targets)
            self._computed = torch.tensor(value)
        return self._computed

    def __repr__(self) -> str:
        return f"{type(self).__name__}(task={self.task!r}, classes={self.classes})"


class Accuracy(Classified):
    """The share of right decisions: samples (binary; multiclass, where a sample is right when its class is among
    the `top_k` highest scores), or every (sample, label) pair (multilabel). A binary or multilabel score above
    `threshold` decides 1 (0.5 for probabilities; 0 for logits)."""
    _reductions = {"correct": SUM, "total": SUM}

    def __init__(self, task: str, classes: int, top_k: int = 1, threshold: float = 0.5) -> None:
        self.top_k, self.threshold = top_k, threshold
        super().__init__(task, classes)

    def _batch_state(self, preds, target):
        scores, target = self._flat(preds, target)
        if self.task != "multiclass":
            right = (scores > self.threshold) == target.bool()
        elif self.top_k == 1:
            right = scores.argmax(1) == target
        else:
            right = (scores.topk(self.top_k, dim=1).indices == target.unsqueeze(1)).any(1)
        return {"correct": right.sum(), "total": _count(right.numel(), right)}

    def _value(self, correct, total):
        return _ratio(correct, total)


class ClassCounts(Classified):
    """Precision, recall or F1: per class (multiclass; the class of the highest score) or label (multilabel),
    averaged over the classes that occur in the targets or the decisions (multiclass) or over every label
    (multilabel); binary scores the positive class. A score whose denominator is 0 counts 0. A binary or multilabel
    score above `threshold` decides 1, as in Accuracy."""
    _reductions = {"tp": SUM, "fp": SUM, "fn": SUM}
    SCORES = ("precision", "recall", "f1")

    def __init__(self, score: str, task: str, classes: int, threshold: float = 0.5) -> None:
        if score not in self.SCORES:
            raise ValueError(f"score must be one of {self.SCORES}; got {score!r}")
        self.score, self.threshold = score, threshold
        super().__init__(task, classes)

    def _shape(self, name):
        return () if self.task == "binary" else (self.classes,)

    def _batch_state(self, preds, target):
        scores, target = self._flat(preds, target)
        if self.task == "multiclass":
            # one column per class, compared: no device-side check of the classes (a wrong one is refused when the
            # value is read)
            classes = torch.arange(self.classes, device=target.device)
            decided, target = scores.argmax(1, keepdim=True) == classes, target.long().unsqueeze(1) == classes
        else:
            decided, target = scores > self.threshold, target.bool()
        return {"tp": (decided & target).sum(0), "fp": (decided & ~target).sum(0), "fn": (~decided & target).sum(0)}

    def _value(self, tp, fp, fn):
        if self.score == "precision":
            scores = _ratio(tp, tp + fp)
        elif self.score == "recall":
            scores = _ratio(tp, tp + fn)
        else:
            scores = _ratio(2 * tp, 2 * tp + fp + fn)
        if self.task == "binary":
            return scores
        counted = (tp + fp + fn > 0) if self.task == "multiclass" else torch.ones_like(tp, dtype=torch.bool)
        return _ratio((scores * counted).sum(), counted.sum())

    def __repr__(self) -> str:
        return f"ClassCounts({self.score!r}, task={self.task!r}, classes={self.classes})"


class AUROC(Classified):
    """The area under the ROC curve from every score (exact, ties as one threshold): binary; one class against the
    rest (multiclass) or per label (multilabel), averaged over the classes or labels. A class or label without
    positive (or negative) samples has an area of 0, with a warning, as torchmetrics gives it."""
    _reductions = {"scores": CAT, "labels": CAT}

    def _shape(self, name):
        return (0, self.classes) if self.task == "multilabel" or (name == "scores" and self.task == "multiclass") \
            else (0,)

    def _dtype(self, name):
        return torch.float32 if name == "scores" else torch.long

    def _batch_state(self, preds, target):
        scores, target = self._flat(preds, target)
        return {"scores": scores.detach().float(), "labels": target.long()}

    def _value(self, scores, labels):
        if self.task == "binary":
            return _area(scores, labels)
        columns = [labels[:, column] if self.task == "multilabel" else (labels == column).long()
                   for column in range(self.classes)]
        return torch.stack([_area(scores[:, column], positive) for column, positive in enumerate(columns)]).mean()


def _area(scores: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The trapezoid area under the ROC curve of one column, a point per distinct score."""
    order = torch.argsort(scores, descending=True)
    scores, labels = scores[order], labels[order]
    last = torch.arange(len(scores), device=scores.device)[-1:]   # the last position (none without scores)
    last_of_each_score = torch.cat([torch.where(scores[1:] != scores[:-1])[0], last])
    true_positives = labels.cumsum(0)[last_of_each_score]
    false_positives = 1 + last_of_each_score - true_positives
    rates = []
    for count, what in ((false_positives, "negative"), (true_positives, "positive")):
        count = torch.cat([count.new_zeros(1), count]).float()
        if count[-1] <= 0:
            warnings.warn(f"auroc: no {what} samples among the targets: the area is 0 for that class", UserWarning,
                          stacklevel=2)
            rates.append(torch.zeros_like(count))
        else:
            rates.append(count / count[-1])
    return torch.trapezoid(rates[1], rates[0])


# ---- regression --------------------------------------------------------------------------------------------------

class MeanError(NamedMetric):
    """The mean absolute or squared error over every output element; `root` gives the root of the mean."""
    _reductions = {"sum_error": SUM, "total": SUM}

    def __init__(self, squared: bool, root: bool = False) -> None:
        self.squared, self.root = squared, root
        super().__init__()

    def _dtype(self, name):
        return torch.float32 if name == "sum_error" else torch.long

    def _batch_state(self, preds, target):
        _check_same_shape(preds, target, "regression")
        difference = preds - target
        error = difference * difference if self.squared else difference.abs()
        return {"sum_error": error.sum(), "total": _count(target.numel(), target)}

    def _value(self, sum_error, total):
        mean = sum_error / total
        return mean.sqrt() if self.root else mean

    def __repr__(self) -> str:
        return f"MeanError(squared={self.squared}, root={self.root})"


class R2(NamedMetric):
    """The coefficient of determination, averaged over the outputs of a 2-D target; an output whose targets are
    constant scores 1 when it is predicted exactly, else 0."""
    _reductions = {"sum_squared_obs": SUM, "sum_obs": SUM, "rss": SUM, "total": SUM}

    def _shape(self, name):
        return () if name == "total" else (1,)   # (outputs,) from a 2-D target's first batch on

    def _dtype(self, name):
        return torch.long if name == "total" else torch.float32

    def _batch_state(self, preds, target):
        _check_same_shape(preds, target, "regression")
        if preds.dim() > 2:
            raise ValueError(f"r2 takes 1-D or 2-D outputs and targets; got shape {tuple(preds.shape)}. Flatten "
                             "them to (samples, outputs) in the net, or use 'mse' / 'mae'.")
        residual = target - preds
        return {"sum_squared_obs": (target * target).sum(0), "sum_obs": target.sum(0),
                "rss": (residual * residual).sum(0), "total": _count(target.shape[0], target)}

    def _value(self, sum_squared_obs, sum_obs, rss, total):
        if total < 2:
            raise ValueError(f"r2 needs at least two samples; got {int(total)}. Evaluate on more samples, or use "
                             "'mse' / 'mae'.")
        total_sum_of_squares = sum_squared_obs - sum_obs * (sum_obs / total)
        explained = ~torch.isclose(rss, torch.zeros_like(rss), atol=1e-4)
        varies = ~torch.isclose(total_sum_of_squares, torch.zeros_like(total_sum_of_squares), atol=1e-4)
        scores = torch.ones_like(rss)
        scores[explained & varies] = 1 - rss[explained & varies] / total_sum_of_squares[explained & varies]
        scores[explained & ~varies] = 0.0
        return scores.mean()


# ---- checks --------------------------------------------------------------------------------------------------------

def _check_same_shape(preds: torch.Tensor, target: torch.Tensor, kind: str) -> None:
    if preds.shape != target.shape:
        raise ValueError(f"the {kind} metrics need outputs and targets of one shape; got outputs of shape "
                         f"{tuple(preds.shape)} and targets of shape {tuple(target.shape)}. Give targets shaped "
                         "like the net's outputs.")
