"""Sample and class weights: the loss of a batch is sum(weight_i * loss_i) / batch size, as Keras computes it.

Only a fit given weights uses anything here: without them the step runs exactly as before, at no extra cost."""
from __future__ import annotations

import copy
import functools
import inspect
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from easyfit.data.batches import TensorBatches
from easyfit.data.source import BatchSource, WrappedBatches
from easyfit.parts.item_counts import refuse_weights
from easyfit.parts.losses import check_targets

#: reductions after which a loss sums over a sample's elements (else it averages them)
SUMMING = ("sum", "batchmean")


def validation_weight(validation_data: Any) -> tuple[Any, Any]:
    """(validation data without weights, its sample weights or None): `(x, y, w)` gives `((x, y), w)`."""
    if isinstance(validation_data, tuple) and len(validation_data) == 3:
        x, y, weight = validation_data
        return (x, y), weight
    return validation_data, None


def weigh_batches(loss_fn: Callable, train, val, sample_weight: Any, class_weight: Mapping | None,
                  val_weight: Any, split: bool):
    """(train, val, weighted loss) for a fit with weights. `split`: `val` was held out of the training data by
    validation_split, so it takes the held-out part of `sample_weight`."""
    loss = WeightedLoss(loss_fn)
    weights = None
    if class_weight is not None:
        weights = class_weights(_tensors(train, "class_weight")[-1], class_weight)
    elif sample_weight is not None:
        weights = _as_weights(sample_weight, "sample_weight")
        train_count = len(_tensors(train, "sample_weight")[0])
        if split:
            weights, val_weight = weights[:train_count], weights[train_count:]
        _check_count(weights, train_count, "sample_weight", "training samples")
    train = WeightedBatches(_with(train, weights), loss)
    if val is not None:
        if val_weight is not None:
            val_weight = _as_weights(val_weight, "validation_data's sample weights")
            _check_count(val_weight, len(_tensors(val, "validation sample weights")[0]), "the validation sample "
                         "weights", "validation samples")
        val = WeightedBatches(_with(val, val_weight), loss)
    return train, val, loss


def class_weights(target: torch.Tensor, class_weight: Mapping) -> torch.Tensor:
    """One weight per sample from its class: integer labels, one-hot rows (argmax) or 0/1 floats (rounded);
    classes missing from `class_weight` weigh 1."""
    if not isinstance(class_weight, Mapping):
        raise TypeError(f"class_weight must be a dict {{class index: weight}}, got {type(class_weight).__name__}")
    if any(isinstance(key, bool) or not isinstance(key, int) for key in class_weight):
        raise ValueError(f"class_weight keys must be integer class indices, got {list(class_weight)}")
    labels = target
    if labels.dim() > 1:
        labels = labels.argmax(-1) if labels.shape[-1] != 1 else labels.squeeze(-1)
    labels = labels.round().long() if labels.is_floating_point() else labels.long()
    table = torch.ones(int(max(labels.max().item(), max(class_weight, default=0))) + 1)
    for key, value in class_weight.items():
        if key >= 0:
            table[key] = float(value)
    return table[labels.cpu()].to(target.device)


class WeightedLoss:
    """The user's loss, weighted per sample by the weights of the batch being computed (set by WeightedBatches).

    A batch without weights gets the plain loss."""

    def __init__(self, loss_fn: Callable):
        self.loss_fn = loss_fn
        self.per_sample, self.sums_elements, self.sums_batch = _per_sample(loss_fn)
        self.weights: torch.Tensor | None = None
        self.checked = False

    def __call__(self, output, target) -> torch.Tensor:
        return self.weighted(output, target, self.weights)

    def weighted(self, output, target, weights: torch.Tensor | None) -> torch.Tensor:
        """The loss of a batch weighted by `weights` (a compiled run of several steps passes each batch's)."""
        if not self.checked:
            check_targets(self.loss_fn, output, target)
            refuse_weights(self.loss_fn, target)
            self.checked = True
        if weights is None:
            return self.loss_fn(output, target)
        values = self.per_sample(output, target)
        if not isinstance(values, torch.Tensor) or values.dim() == 0 or values.shape[0] != len(weights):
            raise ValueError(
                "sample or class weights need one loss value per sample, but the loss returned "
                f"{_describe(values)} for a batch of {len(weights)}. Pass a loss name, an nn.Module loss "
                "with a `reduction` argument, or a function whose result has one value per sample (shape [batch])")
        values = values.reshape(len(values), -1)
        values = values.sum(1) if self.sums_elements else values.mean(1)
        weighted = (values * weights.to(values.dtype)).sum()
        return weighted if self.sums_batch else weighted / len(values)


class WeightedBatches(WrappedBatches):
    """Yields each batch without its last tensor, the weights, which it hands to `loss` (None: no weights)."""

    def __init__(self, batches: BatchSource, loss: WeightedLoss):
        super().__init__(batches, batches.weighted)
        self.loss = loss

    def __iter__(self):
        loss = self.loss
        for batch in self.batches:
            if self.weighted:
                *batch, loss.weights = batch
                batch = tuple(batch)
            else:
                loss.weights = None
            yield batch


def _per_sample(loss_fn: Callable) -> tuple[Callable, bool, bool]:
    """(function giving per-sample losses, whether a sample's elements are summed, whether the batch is summed)."""
    reduction = getattr(loss_fn, "reduction", None)
    if isinstance(loss_fn, nn.Module) and isinstance(reduction, str):
        if getattr(loss_fn, "weight", None) is not None and isinstance(loss_fn, (nn.CrossEntropyLoss, nn.NLLLoss)):
            raise ValueError(f"{type(loss_fn).__name__}(weight=...) cannot be combined with sample or class weights: "
                             "pass the class weights as fit(class_weight={class: weight}) instead")
        unreduced = copy.copy(loss_fn)
        unreduced.reduction = "none"
        return unreduced, reduction in SUMMING, reduction == "sum"
    if _accepts_reduction(loss_fn):
        return functools.partial(loss_fn, reduction="none"), False, False
    return loss_fn, False, False


def _accepts_reduction(function: Callable) -> bool:
    try:
        return "reduction" in inspect.signature(function).parameters
    except (TypeError, ValueError):
        return False


def _tensors(batches, name: str) -> tuple[torch.Tensor, ...]:
    if not isinstance(batches, TensorBatches):
        raise ValueError(f"{name} needs the data as arrays or tensors (x, y), or a TensorDataset; this data is "
                         "batched by a DataLoader or an iterable. Put the weights into the loss instead.")
    return batches.tensors


def _with(batches: BatchSource, weights: torch.Tensor | None) -> BatchSource:
    """The batches, their weights added as a last tensor indexed with the rest (unchanged when None)."""
    if weights is None:
        return batches
    return TensorBatches((*batches.tensors, weights.to(batches.tensors[0].device)), batches.batch_size,
                         batches.sampler, batches.device, names=batches.names, sharded=batches.sharded, weighted=True)


def _as_weights(weights: Any, name: str) -> torch.Tensor:
    tensor = torch.as_tensor(weights.to_numpy() if hasattr(weights, "to_numpy") else weights)
    if tensor.dim() == 2 and tensor.shape[1] == 1:
        tensor = tensor.squeeze(1)
    if tensor.dim() != 1 or tensor.dtype == torch.bool or tensor.is_complex():
        raise ValueError(f"{name} must be one real number per sample (shape [samples]), got {tensor.dtype} of "
                         f"shape {tuple(tensor.shape)}")
    return tensor.float()


def _check_count(weights: torch.Tensor, expected: int, name: str, what: str) -> None:
    if len(weights) != expected:
        raise ValueError(f"{name} has {len(weights)} entries but there are {expected} {what}; give one weight per "
                         "sample")


def _describe(values) -> str:
    if isinstance(values, torch.Tensor):
        return "a scalar" if values.dim() == 0 else f"shape {tuple(values.shape)}"
    return type(values).__name__
