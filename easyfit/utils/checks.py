"""Argument checks shared by the public calls: each names what was wrong and how to fix it."""
from __future__ import annotations

import difflib
import math
import numbers
import os


def closest_name(name: str, choices) -> str:
    """' Did you mean ...?' naming the closest valid name (and a second one nearly as close), or ''."""
    scored = sorted(((difflib.SequenceMatcher(None, name, choice).ratio(), choice) for choice in choices), reverse=True)
    matches = [choice for score, choice in scored[:2] if score >= max(0.6, scored[0][0] - 0.15)]
    return f" Did you mean {' or '.join(repr(match) for match in matches)}?" if matches else ""


def check_positive_int(value, name: str, expected: str = "a positive integer") -> None:
    """Raise unless `value` is an int >= 1 (a bool is not a count); `expected` words the rule in the message."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be {expected}, got {value!r}")


def check_positive_number(value, name: str, expected: str = "a positive number") -> None:
    """Raise unless `value` is a finite real number > 0 (not a bool, not NaN)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0 < value < math.inf:
        raise ValueError(f"{name} must be {expected}, got {value!r}")


def check_non_negative_int(value, name: str, expected: str = "a non-negative integer") -> None:
    """Raise unless `value` is an int >= 0 (not a bool)."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{name} must be {expected}, got {value!r}")


def check_non_negative_number(value, name: str, expected: str = "a non-negative number") -> None:
    """Raise unless `value` is a finite real number >= 0 (not a bool, not NaN)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0 <= value < math.inf:
        raise ValueError(f"{name} must be {expected}, got {value!r}")


def check_flag(value, name: str) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {value!r}")


def check_not_a_path(data, name: str) -> None:
    """Data given as a file name: easyfit takes arrays, tensors, datasets and loaders, and reads no files."""
    if isinstance(data, (str, bytes, os.PathLike)):
        raise TypeError(f"{name} is a {type(data).__name__} ({data!r}), but easyfit reads no files: load the data "
                        "first, e.g. numpy.loadtxt(path, delimiter=',') or pandas.read_csv(path), and pass arrays, "
                        "tensors, a Dataset or a DataLoader.")


def check_model_arguments(optimizer, metrics, lr, scheduler_interval) -> None:
    """Model(...) arguments that would be ignored or fail later: lr beside a built optimizer, a metric class."""
    if scheduler_interval not in ("epoch", "step"):
        raise ValueError(f"scheduler_interval must be 'epoch' or 'step', got {scheduler_interval!r}")
    if lr is not None and isinstance(optimizer, str):
        check_non_negative_number(lr, "lr", f"a non-negative number (the learning rate of {optimizer!r}, e.g. 1e-3; "
                                  "0 leaves the weights as they are)")
    if lr is not None and not isinstance(optimizer, str):
        raise ValueError(f"lr={lr!r} applies only to an optimizer given by name, but this optimizer "
                         f"({type(optimizer).__name__}) sets its own learning rate. Set it there, e.g. "
                         f"torch.optim.SGD(net.parameters(), lr={lr!r}), or pass optimizer='sgd', lr={lr!r}.")
    values = metrics.values() if isinstance(metrics, dict) else metrics if isinstance(metrics, (list, tuple)) \
        else [metrics]
    for metric in values:
        if isinstance(metric, type):
            raise TypeError(f"metrics holds the class {metric.__name__}; pass an instance, e.g. "
                            f"{metric.__name__}(task='multiclass', num_classes=10), or a name such as 'accuracy'.")



def check_verbose(verbose) -> None:
    if verbose != "auto" and (not isinstance(verbose, int) or not 0 <= verbose <= 2):
        raise ValueError(f"verbose must be 0 (silent), 1 (a progress bar), 2 (one line per epoch) or 'auto', "
                         f"got {verbose!r}")



def validation_parts(data) -> tuple:
    """validation_data as (x, y, sample_weight): a tuple or list (x, y) or (x, y, sample_weight) of arrays, or
    (data, None, None) for a Dataset, a DataLoader or an iterable of batches."""
    check_not_a_path(data, "validation_data")
    if isinstance(data, (tuple, list)) and len(data) in (2, 3) and _is_array(data[0]) \
            and all(_is_array(part) or part is None for part in data[1:]):
        return (*data, None)[:3]
    if isinstance(data, tuple) and len(data) == 2:   # e.g. ((x1, x2), y) for a net with two inputs
        return (*data, None)
    return data, None, None


def validation_tuple(data):
    """validation_data as fit takes it: a tuple (x, y) or (x, y, sample_weight) for arrays (a list is accepted, as in
    Keras), the data itself otherwise."""
    if data is None:
        return None
    x, y, sample_weight = validation_parts(data)
    if y is None:
        return data
    return (x, y) if sample_weight is None else (x, y, sample_weight)


def _is_array(value) -> bool:
    """An array or tensor, or a dict of them (the inputs of a multi-input net by name)."""
    if isinstance(value, dict):
        return bool(value) and all(_is_array(item) for item in value.values())
    return hasattr(value, "__array__") or hasattr(value, "to_numpy") or type(value).__name__ == "Tensor"
