"""What a batch holds: its inputs and its target, its number of samples, and its tensors on a device; the net called
on its inputs."""
from __future__ import annotations

from typing import Any, Callable

import torch

from easyfit.utils.tensors import map_tensors


def move_to_device(batch: Any, device: torch.device) -> Any:
    """Move every tensor in a (nested) tuple / list / dict batch to `device`."""
    return map_tensors(lambda tensor: tensor if tensor.device == device else tensor.to(device, non_blocking=True),
                       batch)


def split_batch(batch: Any) -> tuple[Any, Any]:
    """(inputs, target) from a batch: (x, y) / [x, y] / (x,) / x / {"...": ..., "y"|"target"|"label": ...}."""
    if isinstance(batch, (tuple, list)):
        if len(batch) == 2:
            return batch[0], batch[1]
        if len(batch) == 1:
            return batch[0], None
        return tuple(batch[:-1]), batch[-1]
    if isinstance(batch, dict):
        for key in TARGET_KEYS:
            if key in batch:
                inputs = {k: v for k, v in batch.items() if k != key}
                return (next(iter(inputs.values())) if len(inputs) == 1 else inputs), batch[key]
        return batch, None
    return batch, None


TARGET_KEYS = ("y", "target", "targets", "label", "labels")


def with_target_dtype(batch: Any, dtype: torch.dtype) -> Any:
    """The batch with its target (as `split_batch` finds it) as `dtype` (int64 class indices from other integer or
    bool labels, floats from bool labels for a binary loss)."""
    target = split_batch(batch)[1]
    if not isinstance(target, torch.Tensor) or target.dtype == dtype:
        return batch
    if isinstance(batch, dict):
        key = next(key for key in TARGET_KEYS if key in batch)
        return {**batch, key: target.to(dtype)}
    converted = target.to(dtype)
    return type(batch)([*batch[:-1], converted]) if isinstance(batch, list) else (*batch[:-1], converted)


def batch_length(batch: Any) -> int:
    """Number of samples in a batch: the first dimension of its first tensor."""
    while not isinstance(batch, torch.Tensor):
        if isinstance(batch, dict):
            batch = next(iter(batch.values()))
        elif isinstance(batch, (tuple, list)) and batch:
            batch = batch[0]
        else:
            return 1
    return batch.shape[0] if batch.dim() else 1


def call_net(net: Callable, inputs: Any):
    """The net's output for a batch's inputs: a tuple as positional arguments, a dict as keyword arguments."""
    if isinstance(inputs, tuple):
        return net(*inputs)
    if isinstance(inputs, dict):
        return net(**inputs)
    return net(inputs)


def forward_loss(net, loss_fn: Callable | None, inputs, target):
    """(output, loss) of one batch, run eagerly; no loss without `loss_fn` (predict)."""
    output = call_net(net, inputs)
    return output, None if loss_fn is None else loss_fn(output, target)
