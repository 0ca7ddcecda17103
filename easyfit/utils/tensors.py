"""One walk over the nested tuples, lists and dicts that batches and outputs are made of."""
from __future__ import annotations

from typing import Any, Callable

import torch


def map_tensors(function: Callable[[torch.Tensor], Any], obj: Any) -> Any:
    """`obj` with `function` applied to every tensor in it (nested tuples, lists and dicts keep their shape)."""
    if isinstance(obj, torch.Tensor):
        return function(obj)
    if isinstance(obj, (tuple, list)):
        return type(obj)(map_tensors(function, item) for item in obj)
    if isinstance(obj, dict):
        return {key: map_tensors(function, value) for key, value in obj.items()}
    return obj


def on_cpu(obj: Any) -> Any:
    """`obj` with every tensor in it detached and on the CPU (a CPU tensor is the same storage, detached)."""
    return map_tensors(lambda tensor: tensor.detach().cpu(), obj)


def sample_count(x: Any) -> int:
    """Samples in in-memory data: the length of x, or of its first array for a multi-input list / tuple / dict."""
    if isinstance(x, dict) and x:
        return len(next(iter(x.values())))
    return len(x[0] if isinstance(x, (list, tuple)) else x)
