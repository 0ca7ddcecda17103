"""In-memory data (arrays, tensors, DataFrames) brought once to what the net and the loss take, as Keras does:
- floating inputs and targets become the net's float dtype (float16 or float64 data for a float32 net; float64 under
  precision="64");
- integer and bool inputs (uint8 images, 0/1 flags, counts) stay as they are when the net runs on them (an
  nn.Embedding takes integer indices); when the net raises on them, they become floats and the first step runs
  again (the forward that raised is the only repeated call). uint8 images are not rescaled: divide them by 255;
- integer class labels of shape (N, 1) for a class-index loss (cross_entropy, nll) become shape (N,).
Integer class labels of any integer dtype (int32, int16, uint8, bool, ...) become int64 for a class-index loss, and
bool labels become floats for a binary loss (bce, bce_with_logits), in memory and in the batches of a Dataset or
DataLoader (lossless).
"""
from __future__ import annotations

import torch
from torch import nn

from easyfit.data.batches import TensorBatches
from easyfit.data.explain import float_dtype
from easyfit.parts.losses import BINARY_LOSSES, CLASS_INDEX_LOSSES


def _is_class_index(loss_fn, target: torch.Tensor) -> bool:
    return isinstance(loss_fn, CLASS_INDEX_LOSSES) and not target.is_floating_point() and not target.is_complex()


def _target_index(batches: TensorBatches) -> int:
    """Where the target lies among in-memory tensors: last, or before the sample weights."""
    return -2 if batches.weighted else -1


def data_dtype(net: nn.Module, precision) -> torch.dtype:
    """The dtype in-memory float data is conformed to: the net's, unless the backend casts the inputs itself."""
    return torch.float32 if precision.casts_inputs else float_dtype(net)


def conform(batches: TensorBatches, loss_fn, dtype: torch.dtype) -> None:
    """In-memory floats as `dtype`; with a `loss_fn` (None: inputs only), the labels as it takes them: integer or bool
    class indices as int64 for a class-index loss, bool flags as floats for a binary loss (0 / 1, lossless)."""
    tensors, index = [t.to(dtype) if t.is_floating_point() else t for t in batches.tensors], _target_index(batches)
    if loss_fn is not None and not batches.inputs_only and len(tensors) >= 1 - index:   # inputs, target (weights)
        target = tensors[index]
        if _is_class_index(loss_fn, target) and target.dtype != torch.int64:
            tensors[index] = target.long()
        elif isinstance(loss_fn, BINARY_LOSSES) and target.dtype == torch.bool:
            tensors[index] = target.to(dtype)
    batches.tensors = tuple(tensors)


def class_targets(batches, output: torch.Tensor, target: torch.Tensor, loss_fn) -> torch.Tensor:
    """A first batch's target as the loss takes it, and the batches' targets from then on: bool flags as the
    output's floats for a binary loss, (N, 1) class labels of in-memory data squeezed (as Keras does), integer class
    labels as int64."""
    if target.dtype == torch.bool and isinstance(loss_fn, BINARY_LOSSES):
        batches.target_dtype = output.dtype if output.is_floating_point() else torch.float32
        return target.to(batches.target_dtype)
    if not _is_class_index(loss_fn, target):
        return target
    if output.dim() == 2 and target.shape[1:] == (1,) and isinstance(batches, TensorBatches):
        tensors = list(batches.tensors)
        tensors[_target_index(batches)] = tensors[_target_index(batches)].view(-1)
        batches.tensors = tuple(tensors)
        target = target.view(-1)
    if target.dtype != torch.int64:
        batches.target_dtype = torch.int64   # the batches of a loader from now on; in-memory data is int64 already
        target = target.long()
    return target


def class_labels(batches, loss_fn, target: torch.Tensor) -> torch.Tensor | None:
    """Every class label of in-memory data, to check at once; None for other data or another kind of loss."""
    if isinstance(batches, TensorBatches) and _is_class_index(loss_fn, target):
        return batches.tensors[_target_index(batches)]
    return None


def _input_count(batches: TensorBatches) -> int:
    """How many of the tensors are the net's inputs (the last one is the target when there are several)."""
    if batches.inputs_only:
        return len(batches.tensors)
    return max(1, len(batches.tensors) + _target_index(batches))


def integers_to_floats(batches: TensorBatches, dtype: torch.dtype) -> bool:
    """Turn integer and bool inputs into `dtype`; False when there were none."""
    count, tensors = _input_count(batches), batches.tensors
    if all(t.is_floating_point() or t.is_complex() for t in tensors[:count]):
        return False
    batches.tensors = tuple(t.to(dtype) if i < count and not t.is_floating_point() else t
                            for i, t in enumerate(tensors))
    return True
