"""Map-style data by protocol: anything with `__len__` and `__getitem__` (a torch Dataset, a Hugging Face
`datasets.Dataset`, a list of sample dicts) is sampled and batched by easyfit, fetched one batch per call where the
data has `__getitems__` (torch's DataLoader uses it: Hugging Face's columnar fetch); and the samples' collation."""
from __future__ import annotations

import numbers
import warnings
from collections.abc import Mapping
from typing import Any, Callable

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset
from torch.utils.data.dataloader import default_collate


def is_map_style(x: Any) -> bool:
    """Whether easyfit samples and batches `x` itself: it has a length and takes an index. Arrays, tensors, strings
    and dicts are not (arrays are batched by indexing, a dict holds named inputs); a list or tuple is when it holds
    sample dicts (else it is a list of batches, iterated as it is: see `is_sample`)."""
    if isinstance(x, (str, bytes, Mapping, torch.Tensor, np.ndarray, DataLoader, IterableDataset)) or \
            hasattr(x, "__array__"):
        return False
    if not (hasattr(x, "__len__") and hasattr(x, "__getitem__")):
        return False
    if isinstance(x, (list, tuple)):
        return bool(x) and all(isinstance(item, Mapping) for item in x[:2]) and is_sample(x[0])
    return True


def dicts_to_collate(x: Any, collate_fn: Callable | None) -> bool:
    """Whether a list or tuple of dicts that `is_sample` reads as batches is a list of samples all the same: a
    `collate_fn` was given to batch them."""
    return collate_fn is not None and isinstance(x, (list, tuple)) and bool(x) and \
        all(isinstance(item, Mapping) for item in x[:2])


def warn_dicts_read_as_batches(x: Any) -> None:
    """A list of dicts of 1-D tensors of one length is read as a list of batches, each dict a batch of that many
    samples: say so when each dict may be one sample (a token sequence), and how to batch them instead."""
    if not (isinstance(x, (list, tuple)) and x and isinstance(x[0], Mapping) and x[0]):
        return
    values = list(x[0].values())
    if not all(isinstance(value, (torch.Tensor, np.ndarray)) and value.ndim == 1 for value in values):
        return
    warnings.warn(f"the list of {len(x)} dicts is read as a list of batches: each dict one batch of "
                  f"{len(values[0])} samples (the first dimension of its entries {', '.join(map(repr, x[0]))}), "
                  f"so the net gets 1-D inputs. If each dict is one sample (e.g. a sequence of {len(values[0])} "
                  "tokens), batch them: pass collate_fn=torch.utils.data.default_collate (or a padding collator, "
                  "e.g. transformers.DataCollatorWithPadding(tokenizer)), or wrap the list in a torch Dataset.",
                  stacklevel=2)


def check_not_splits(x: Any) -> None:
    """Refuse a Hugging Face DatasetDict (the splits of a data set, a dict of datasets), naming the fix."""
    if isinstance(x, Mapping) and x and all(is_map_style(value) or isinstance(value, IterableDataset)
                                            for value in x.values()):
        raise ValueError(f"the data is a {type(x).__name__} of the splits {', '.join(map(repr, x))}; pass one split, "
                         f"e.g. fit(data[{next(iter(x))!r}]), and another as validation_data")


def is_sample(item: Mapping) -> bool:
    """Whether a dict is one sample rather than a batch: a batch holds only tensors or arrays with a first
    dimension, all of one length; a sample holds a number, a 0-dim tensor, a list or a string somewhere, or
    tensors of different lengths (a dict of tensors of one length is read as a batch)."""
    lengths = set()
    for value in item.values():
        if not (isinstance(value, torch.Tensor) or isinstance(value, np.ndarray)) or value.ndim == 0:
            return True
        lengths.add(value.shape[0])
    return len(lengths) > 1


def map_style_loader(dataset: Any, batch_size: int, sampler, collate_fn: Callable | None, num_workers: int,
                     device: torch.device) -> DataLoader:
    """A DataLoader over map-style data, with easyfit's sampler (each process's share) and the user's collator or
    `collate_samples`."""
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler, num_workers=num_workers,
                      collate_fn=collate_fn or collate_samples, pin_memory=device.type == "cuda",
                      persistent_workers=num_workers > 0)


def collate_samples(samples: list) -> Any:
    """torch's default collation, after the numbers and lists of numbers in each sample (what an unformatted
    Hugging Face dataset gives) became tensors; samples of different lengths are explained."""
    try:
        return default_collate([_numbers_as_tensors(sample) for sample in samples])
    except RuntimeError as error:
        if "stack expects each tensor to be equal size" not in str(error):
            raise
        raise ValueError(f"the samples of a batch have different lengths ({error}), so they cannot be stacked into "
                         "one tensor. Pad them: pass a collator, e.g. fit(..., collate_fn=transformers."
                         "DataCollatorWithPadding(tokenizer)), or give every sample one length.") from None


def _numbers_as_tensors(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {key: _numbers_as_tensors(item) for key, item in value.items()}
    if isinstance(value, list) and _numbers(value):
        return torch.tensor(value)
    if isinstance(value, tuple):
        return tuple(_numbers_as_tensors(item) for item in value)
    return value


def _numbers(values: list) -> bool:
    """A (nested) list of numbers, judged by its first elements."""
    while isinstance(values, list):
        if not values:
            return False
        values = values[0]
    return isinstance(values, numbers.Number)
