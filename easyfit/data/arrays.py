"""The user's arrays as tensors: numpy arrays, pandas DataFrames and Series, nested lists, numpy object arrays of
numbers, and the numpy arrays inside the batches of an iterable."""
from __future__ import annotations

import numbers
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from easyfit.utils.checks import check_not_a_path


def as_tensor(array: Any, name: str, float_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A numpy array / pandas DataFrame or Series / list / tensor as a tensor; float64 numpy data becomes
    `float_dtype` (float32, PyTorch's default; float64 in a run with precision "64")."""
    if isinstance(array, torch.Tensor):
        return array
    check_not_a_path(array, name)
    if type(array).__name__ in ("DataFrame", "Series") and hasattr(array, "to_numpy"):
        array = _frame_to_numpy(array, name)
    if isinstance(array, np.ndarray) and array.dtype == object:
        array = numbers_from_objects(array, name)
    if not getattr(getattr(array, "flags", None), "writeable", True):
        array = array.copy()   # torch shares a numpy array's memory and cannot use a read-only one
    try:
        tensor = torch.as_tensor(array)
    except (TypeError, ValueError, RuntimeError) as error:
        raise TypeError(f"{name} could not be turned into a tensor ({type(array).__name__}): {error}") from None
    return tensor.to(float_dtype) if tensor.dtype == torch.float64 else tensor


def numbers_from_objects(array: np.ndarray, name: str) -> np.ndarray:
    """A numpy object array of numbers (what DataFrame.values gives for mixed columns) as int64 when every element is
    an integer or a bool, else as float64; an element that is not a number is named, with its row and column."""
    kinds = np.frompyfunc(_number_kind, 1, 1)(array).astype(np.int8) if array.size else np.ones(array.shape, np.int8)
    if (kinds == 0).any():
        index = np.unravel_index(int(np.argmin(kinds)), array.shape)
        value = array[index]
        where = f"row {index[0]}, column {index[1]}" if array.ndim == 2 else f"element {tuple(map(int, index))}"
        raise TypeError(f"{name} is a numpy object array whose {where} holds {value!r} ({type(value).__name__}), "
                        "which is not a number. easyfit casts object arrays to numbers (as Keras does) when every "
                        "element is one: encode that column as numbers first, or drop it.")
    return array.astype(np.int64 if (kinds == 1).all() else np.float64)


def _number_kind(value: Any) -> int:
    """1 for an integer or a bool, 2 for another real number, 0 for anything else."""
    if isinstance(value, (bool, np.bool_, numbers.Integral)):
        return 1
    return 2 if isinstance(value, numbers.Real) else 0


def _frame_to_numpy(frame: Any, name: str):
    """A pandas DataFrame / Series as a numeric numpy array (pandas itself is never imported here)."""
    columns = frame.dtypes.items() if hasattr(frame, "columns") else [(frame.name, frame.dtype)]
    text = [f"{column!r} ({dtype})" for column, dtype in columns if getattr(dtype, "kind", "O") not in "biuf"]
    if text:
        raise TypeError(f"{name} is a pandas {type(frame).__name__} with non-numeric column(s) {', '.join(text)}. "
                        "Encode them as numbers first, e.g. pandas.get_dummies(df) or "
                        "df[column].astype('category').cat.codes, or drop them.")
    array = frame.to_numpy()
    return frame.to_numpy(dtype="float64") if array.dtype == object else array   # bool columns beside numbers


def batch_to_device(batch: Any, device: torch.device, float_dtype: torch.dtype = torch.float32) -> Any:
    """A (nested) tuple / list / dict (or other mapping: a dict after) batch with its tensors on `device`, and its
    numpy arrays and pandas objects turned into tensors there first (float64 as `float_dtype`, as fit does for
    arrays). A tensor costs what moving it costs: nothing when it is on the device already."""
    if isinstance(batch, torch.Tensor):
        return batch if batch.device == device else batch.to(device, non_blocking=True)
    if isinstance(batch, (tuple, list)):
        return type(batch)(batch_to_device(item, device, float_dtype) for item in batch)
    if isinstance(batch, Mapping):   # a dict, or a mapping such as transformers' BatchEncoding: a dict from here on
        return {key: batch_to_device(value, device, float_dtype) for key, value in batch.items()}
    if isinstance(batch, np.ndarray) or type(batch).__name__ in ("DataFrame", "Series"):
        return as_tensor(batch, "a batch", float_dtype).to(device)
    return batch
