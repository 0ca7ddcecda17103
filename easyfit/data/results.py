"""What evaluate and predict hand back: scores as a list or a dict, outputs in the kind of the input."""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

LOW_FLOATS = (torch.float16, torch.bfloat16)


def scores_result(logs: dict[str, float], metric_names: list[str], return_dict: bool):
    """`logs` as given with `return_dict`; else the loss alone when there are no metrics, or the list
    [loss, metric, ...] in the order the metrics were given to the Model."""
    if return_dict:
        return logs
    keys = ["loss", *(name for name in metric_names if name in logs)]
    keys += [key for key in logs if key not in keys]
    return logs["loss"] if len(keys) == 1 else [logs[key] for key in keys]


def is_numpy_input(x: Any) -> bool:
    """An array that is not a tensor (numpy, pandas), or a list / tuple / dict (any mapping) of them (the inputs of
    a multi-input net)."""
    if isinstance(x, Mapping) and x:
        return all(is_numpy_input(item) for item in x.values())
    if isinstance(x, (list, tuple)) and x:
        return all(is_numpy_input(item) for item in x)
    return hasattr(x, "__array__") and not isinstance(x, torch.Tensor)


def prediction_result(outputs: Any, numpy: bool, mixed_precision: bool) -> Any:
    """Predicted outputs as numpy arrays for numpy input (tensors otherwise); float32 under mixed precision."""
    if isinstance(outputs, torch.Tensor):
        if mixed_precision and outputs.dtype in LOW_FLOATS:
            outputs = outputs.float()
        return outputs.numpy() if numpy else outputs
    if isinstance(outputs, (tuple, list)):
        return type(outputs)(prediction_result(item, numpy, mixed_precision) for item in outputs)
    if isinstance(outputs, dict):
        return {key: prediction_result(value, numpy, mixed_precision) for key, value in outputs.items()}
    return np.asarray(outputs) if numpy and isinstance(outputs, (int, float)) else outputs
