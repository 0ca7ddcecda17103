"""Turn what the user passes (arrays, tensors, datasets, loaders, iterables) into batches on a device.

In-memory tensors and TensorDatasets are batched by indexing whole batches out of the tensors
(`x[idx]`), which costs one op per tensor instead of collating sample by sample.
"""
from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, Callable

import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, Sampler, Subset, TensorDataset

from easyfit.data.arrays import as_tensor, batch_to_device
from easyfit.data.contents import move_to_device, with_target_dtype
from easyfit.data.map_style import (
    check_not_splits,
    collate_samples,
    dicts_to_collate,
    is_map_style,
    map_style_loader,
    warn_dicts_read_as_batches,
)
from easyfit.data.ray_dataset import RayBatches, is_ray_data
from easyfit.data.samplers import sampler_indices
from easyfit.data.source import BatchSource, WrappedBatches
from easyfit.utils.checks import check_not_a_path, check_positive_int


def batch_count(batches) -> int | None:
    """The number of batches in an epoch, or None when the data does not know it (a generator, a stream)."""
    try:
        return len(batches)
    except TypeError:
        return None


def epoch_length(batches) -> int | None:
    """The number of batches the coming epoch of `batches` yields, where known: a step-limited source's own count
    (fewer than its len() where the data runs out part-way, easyfit.data.steps), else `batch_count`."""
    coming = getattr(batches, "coming_epoch", None)
    return batch_count(batches) if coming is None else coming()


# ----------------------------------------------------------------------------------------
# Batch sources: each yields batches for one epoch, on the target device.
# ----------------------------------------------------------------------------------------
class TensorBatches(BatchSource):
    """Batches indexed straight out of in-memory tensors; with `inputs_only`, each batch is `((x1, x2, ...),)`:
    all the net's inputs, no target. With `names` (a dict of inputs), the first len(names) tensors are the inputs,
    and each batch holds them as one dict: `({name: x, ...}, y)`. `sharded`, `weighted`: see `BatchSource`."""

    def __init__(self, tensors: tuple[torch.Tensor, ...], batch_size: int, sampler: Sampler,
                 device: torch.device, inputs_only: bool = False, names: tuple[str, ...] | None = None,
                 sharded: bool = False, weighted: bool = False):
        super().__init__(sharded, weighted)
        self.batch_size, self.sampler, self.device = batch_size, sampler, device
        self.tensors, self.inputs_only, self.names = tensors, inputs_only, names
        self.on_device = all(t.device == device for t in tensors)

    def structured(self, batch: tuple[torch.Tensor, ...]) -> tuple:
        """A batch of the tensors in the form the loop takes: inputs (a tuple, or a dict by name), target."""
        if self.names is not None:
            count = len(self.names)
            return (dict(zip(self.names, batch[:count])), *batch[count:])
        return (batch,) if self.inputs_only else batch

    def set_epoch(self, epoch: int) -> None:
        set_epoch = getattr(self.sampler, "set_epoch", None)
        if set_epoch is not None:
            set_epoch(epoch)

    def __len__(self) -> int:
        return math.ceil(len(self.sampler) / self.batch_size)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, ...]]:
        indices = sampler_indices(self.sampler)
        if len(indices) == 0:   # e.g. a rank with no share of a tiny evaluation set: no batches at all
            return
        # self.tensors is read per batch: the first step may convert them (integer inputs that the net runs as floats)
        if self.on_device:   # indices on the tensors' device: one gather per tensor, no per-step index copy
            batches = (tuple([t.index_select(0, idx) for t in self.tensors])
                       for idx in indices.to(self.device).split(self.batch_size))
        else:
            batches = (move_to_device(tuple([t[idx] for t in self.tensors]), self.device)
                       for idx in indices.split(self.batch_size))
        yield from (batches if self.names is None and not self.inputs_only else map(self.structured, batches))


class LoaderBatches(BatchSource):
    """Batches from a DataLoader or any re-iterable of batches, moved to the device (numpy arrays in them as
    tensors)."""

    def __init__(self, loader: Iterable, device: torch.device, source: str = "the training data",
                 float_dtype: torch.dtype = torch.float32, sharded: bool = False):
        super().__init__(sharded)
        self.loader, self.device, self.source, self.float_dtype = loader, device, source, float_dtype
        self.epochs_started = 0
        self.target_dtype = None   # set by the first step when the loss takes the labels in another dtype

    def set_epoch(self, epoch: int) -> None:
        sampler = getattr(self.loader, "sampler", None)
        for candidate in (sampler, getattr(self.loader, "batch_sampler", None)):
            set_epoch = getattr(candidate, "set_epoch", None)
            if set_epoch is not None:
                set_epoch(epoch)
                return

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[Any]:
        self.epochs_started += 1
        empty = True
        for batch in self.loader:
            empty = False
            batch = batch_to_device(batch, self.device, self.float_dtype)   # numpy batches as tensors, too
            yield batch if self.target_dtype is None else with_target_dtype(batch, self.target_dtype)
        if empty and self.epochs_started > 1:
            raise ValueError(
                f"{self.source} yielded no batches in epoch {self.epochs_started}: a one-shot iterator or "
                "generator is exhausted after one pass. Pass a re-iterable (a list of batches, a Dataset or a "
                "DataLoader) to use it in several epochs.")


# ----------------------------------------------------------------------------------------
# Normalising user input
# ----------------------------------------------------------------------------------------
def several_inputs(x: Any) -> bool:
    """Whether `x` is a list or tuple of arrays / tensors: one per input of the net (as Keras)."""
    return isinstance(x, (list, tuple)) and bool(x) and all(
        isinstance(item, torch.Tensor) or hasattr(item, "__array__") for item in x)


def keyed_inputs(x: Any) -> bool:
    """Whether `x` is a dict of arrays / tensors: one input of the net per key (Keras' multi-input dict); any mapping
    (a tokenizer's BatchEncoding) is read as a dict."""
    return isinstance(x, Mapping) and bool(x) and all(
        isinstance(item, torch.Tensor) or hasattr(item, "__array__") for item in x.values())


def input_names(x: Any) -> tuple[str, ...] | None:
    """The keys of a dict of several inputs, which the net takes by name (`net(**inputs)`); None otherwise (a dict
    of one entry is that one input, passed as the net's first argument)."""
    return tuple(x) if keyed_inputs(x) and len(x) > 1 else None


def _tensors_from(x: Any, y: Any, float_dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, ...] | None:
    """The tensors behind in-memory data (the inputs, then the target if any), or None when `x` is a dataset /
    loader / iterable of batches."""
    check_not_a_path(x, "x")
    check_not_splits(x)
    if isinstance(x, TensorDataset):
        if y is not None:
            raise ValueError("y was given together with a TensorDataset: the dataset already holds the targets")
        return tuple(x.tensors)
    keyed, several = keyed_inputs(x), several_inputs(x)
    if not keyed and (isinstance(x, (Dataset, DataLoader)) or (not _is_array_like(x) and not several and y is None
                                                                and _is_iterable(x))):
        if y is not None:
            raise ValueError(f"y was given together with a {type(x).__name__}: pass targets inside the data instead")
        return None
    named = [(f"x[{key!r}]", item) for key, item in x.items()] if keyed else \
        [(f"x[{i}]", item) for i, item in enumerate(x)] if several else [("x", x)]
    named += [] if y is None else [("y", y)]
    tensors = tuple(as_tensor(array, name, float_dtype) for name, array in named)
    for (name, _), tensor in zip(named, tensors):
        if tensor.dim() == 0:
            raise ValueError(f"{name} is a scalar; pass an array or tensor whose first dimension indexes samples")
    lengths = {name: len(tensor) for (name, _), tensor in zip(named, tensors)}
    if len(set(lengths.values())) > 1:
        raise ValueError(f"{' and '.join(lengths)} have different numbers of samples: "
                         f"{', '.join(f'{name} has {length}' for name, length in lengths.items())}. "
                         "They must match along the first dimension."
                         + (" (A list or tuple of arrays holds one array per input of the net, as in Keras; pass "
                            "a list of batches as tuples, [(x_batch,), ...], or a DataLoader.)" if several else ""))
    return tensors


def _is_array_like(x: Any) -> bool:
    """A tensor, a numpy array, or nested lists of numbers (not a list of batches of tensors)."""
    if isinstance(x, torch.Tensor) or hasattr(x, "__array__"):
        return True
    while isinstance(x, (list, tuple)) and x:
        x = x[0]
    return isinstance(x, (int, float))


def _is_iterable(x: Any) -> bool:
    try:
        iter(x)
    except TypeError:
        return False
    return True


def split_validation(x: Any, y: Any, validation_split: float, float_dtype: torch.dtype = torch.float32):
    """Hold out the last `validation_split` fraction of the samples (before shuffling), as Keras does.

    Returns ((x_train, y_train), (x_val, y_val)); each pair may be (Dataset, None)."""
    if not isinstance(validation_split, (int, float)) or not 0 <= validation_split < 1:
        raise ValueError(f"validation_split must be a fraction in [0, 1), got {validation_split!r}")
    tensors = _tensors_from(x, y, float_dtype)
    length = len(tensors[0]) if tensors is not None else _dataset_length(x, "validation_split")
    n_train = int(math.floor(length * (1.0 - validation_split)))
    if validation_split > 0 and n_train == length:
        raise ValueError(f"validation_split={validation_split} of {length} samples holds out no sample; "
                         "use a larger fraction or pass validation_data")
    if n_train == 0:
        raise ValueError(f"validation_split={validation_split} of {length} samples leaves no training sample; "
                         "use a smaller fraction")
    if tensors is None:
        return (Subset(x, range(n_train)), None), (Subset(x, range(n_train, length)), None)
    names = input_names(x)
    if names is not None:   # a dict of inputs stays one, each input and the target split alike
        def part(rows: slice) -> tuple:
            return {name: t[rows] for name, t in zip(names, tensors)}, None if y is None else tensors[-1][rows]
        return part(slice(0, n_train)), part(slice(n_train, length))
    train = TensorDataset(*(t[:n_train] for t in tensors))
    val = TensorDataset(*(t[n_train:] for t in tensors))
    return (train, None), (val, None)


def _dataset_length(x: Any, purpose: str) -> int:
    if (isinstance(x, Dataset) or is_map_style(x)) and not isinstance(x, IterableDataset) and hasattr(x, "__len__"):
        return len(x)
    raise ValueError(f"{purpose} needs arrays, tensors or a map-style Dataset with a length; "
                     f"got {type(x).__name__}. Pass validation_data explicitly instead.")


def interleave(parts: list[torch.Tensor]) -> torch.Tensor:
    """Undo EvalSampler's split: parts[r] holds samples r, r+W, ...; return all samples in order."""
    world_size = len(parts)
    total = sum(len(part) for part in parts)
    merged = parts[0].new_empty((total, *parts[0].shape[1:]))
    for rank, part in enumerate(parts):
        merged[rank::world_size] = part
    return merged


def make_batches(x: Any, y: Any, *, batch_size: int, strategy, train: bool, shuffle: bool = False,
                 seed: int = 0, num_workers: int = 0, replace_sampler: bool = True,
                 float_dtype: torch.dtype = torch.float32, collate_fn: Callable | None = None,
                 inputs_only: bool = False) -> BatchSource:
    """Batches for one of fit (train=True) or evaluate/predict (train=False), sharded for `strategy`.
    float64 numpy data becomes `float_dtype`; `collate_fn` collates the samples of data easyfit batches itself;
    `inputs_only` (predict): a Ray Dataset's batches leave its target column out."""
    check_positive_int(batch_size, "batch_size")
    device = strategy.batch_device
    source = "the training data" if train else "the validation data"
    sharded = not train and strategy.world_size > 1   # evaluation data split by easyfit's sampler: see BatchSource
    if is_ray_data(x):
        if y is not None:
            raise ValueError("y was given together with a Ray Dataset: its target is its column 'y' (or 'label', "
                             "'labels', 'target')")
        _refuse_collate_fn(collate_fn, "a Ray Dataset")
        return RayBatches(x, batch_size, device, float_dtype, train, not inputs_only, strategy.global_rank,
                          strategy.world_size)
    tensors = _tensors_from(x, y, float_dtype)
    if tensors is not None:
        _refuse_collate_fn(collate_fn, "arrays and tensors")
        length = len(tensors[0])
        check_not_empty(length)
        sampler = strategy.train_sampler(length, shuffle, seed) if train else strategy.eval_sampler(length)
        names = input_names(x)
        return TensorBatches(tensors, batch_size, sampler, device, names=names, sharded=sharded,
                             inputs_only=y is None and (several_inputs(x) or names is not None))
    if isinstance(x, DataLoader):
        _refuse_collate_fn(collate_fn, "a DataLoader")
        return LoaderBatches(_shard_loader(x, strategy, train, replace_sampler, seed), device, source, float_dtype,
                             sharded and replace_sampler)
    if isinstance(x, IterableDataset):
        loader = DataLoader(shard_iterable(x, strategy, train), batch_size=batch_size, num_workers=num_workers,
                            collate_fn=collate_fn or collate_samples)
        return LoaderBatches(loader, device, source, float_dtype)
    samples = dicts_to_collate(x, collate_fn)
    if isinstance(x, Dataset) or is_map_style(x) or samples:   # a torch / HF dataset, a list of samples to collate
        length = len(x) if samples else _dataset_length(x, "a Dataset")
        check_not_empty(length)
        sampler = strategy.train_sampler(length, shuffle, seed) if train else strategy.eval_sampler(length)
        loader = map_style_loader(x, batch_size, sampler, collate_fn, num_workers, device)
        return LoaderBatches(loader, device, source, float_dtype, sharded)
    _refuse_collate_fn(collate_fn, "an iterable of batches")
    warn_dicts_read_as_batches(x)
    if strategy.world_size > 1:
        _warn_iterable_not_sharded(strategy)
    return LoaderBatches(x, device, source, float_dtype)


def check_not_empty(length: int) -> None:
    """Refuse data of 0 samples, saying so."""
    if length == 0:
        raise ValueError("the data is empty (0 samples); pass at least one sample")


def _refuse_collate_fn(collate_fn, what: str) -> None:
    if collate_fn is not None:
        raise ValueError(f"collate_fn collates the samples of data easyfit batches itself (a Dataset, a Hugging Face "
                         f"dataset, a list of sample dicts), but the data is {what}, whose batches are made "
                         "elsewhere: give the collator to your DataLoader instead, or pass the dataset itself.")


def shard_iterable(dataset: IterableDataset, strategy, train: bool) -> IterableDataset:
    """A Hugging Face IterableDataset split between the processes of a fit (`datasets.distributed.
    split_dataset_by_node`: each process reads its share); another iterable dataset, or evaluation data (whose
    outputs predict returns in order), is read whole by every process, with a warning."""
    if strategy.world_size == 1:
        return dataset
    if train and type(dataset).__module__.startswith("datasets."):
        from datasets.distributed import split_dataset_by_node
        return split_dataset_by_node(dataset, rank=strategy.global_rank, world_size=strategy.world_size)
    _warn_iterable_not_sharded(strategy)
    return dataset


def _warn_iterable_not_sharded(strategy) -> None:
    if strategy.world_size > 1:
        warnings.warn("an iterable dataset cannot be split between processes automatically: every one of the "
                      f"{strategy.world_size} processes reads it whole. Shard it yourself by rank "
                      "(model.global_rank / model.world_size) or pass a map-style Dataset.", stacklevel=3)


def _shard_loader(loader: DataLoader, strategy, train: bool, replace_sampler: bool, seed: int) -> DataLoader:
    """The user's DataLoader, with its sampler replaced by a per-rank one when running on several processes."""
    if strategy.world_size == 1 or not replace_sampler:
        return loader
    if isinstance(loader.dataset, IterableDataset):
        _warn_iterable_not_sharded(strategy)
        return loader
    if loader.batch_sampler is not None and loader.batch_size is None:
        raise ValueError("a DataLoader with a custom batch_sampler cannot be split between processes "
                         "automatically; shard it yourself and pass replace_sampler=False")
    length = len(loader.dataset)
    if not train:
        sampler = strategy.eval_sampler(length)
    elif type(loader.sampler).__name__ in ("RandomSampler", "SequentialSampler"):
        shuffle = type(loader.sampler).__name__ == "RandomSampler"
        sampler = strategy.train_sampler(length, shuffle, seed)
    else:
        sampler = strategy.wrap_user_sampler(loader.sampler)
    return DataLoader(loader.dataset, batch_size=loader.batch_size, sampler=sampler,
                      num_workers=loader.num_workers, collate_fn=loader.collate_fn,
                      pin_memory=loader.pin_memory, drop_last=loader.drop_last,
                      persistent_workers=loader.persistent_workers, worker_init_fn=loader.worker_init_fn,
                      timeout=loader.timeout, prefetch_factor=loader.prefetch_factor if loader.num_workers else None)


def peek_first_batch(batches) -> Any:
    """The first batch of in-memory data, a map-style dataset or a list of batches, on the device; else None
    (a generator or stream is not read ahead). Wrapped batches (step limits, loss="model") give their source's,
    those that add sample weights none."""
    while isinstance(batches, WrappedBatches) and not batches.weighted:
        batches = batches.batches
    if isinstance(batches, TensorBatches):
        batch = tuple(t[:batches.batch_size] for t in batches.tensors)
        return move_to_device(batches.structured(batch), batches.device)
    if not isinstance(batches, LoaderBatches):
        return None
    loader = batches.loader
    if isinstance(loader, (list, tuple)) and loader:
        return batch_to_device(loader[0], batches.device, batches.float_dtype)
    if not isinstance(loader, DataLoader) or isinstance(loader.dataset, IterableDataset):
        return None
    dataset = loader.dataset
    try:
        # the loader's own sampler picks the batch; its shuffling and a dataset's random transforms draw from a
        # copy of the RNG, and a sampler's own generator is restored after
        with torch.random.fork_rng(devices=[]), _generator_kept(getattr(loader, "sampler", None)):
            if loader.batch_sampler is None:   # no automatic batching: each item is a batch
                return batch_to_device(loader.collate_fn(dataset[next(iter(loader.sampler))]), batches.device,
                                       batches.float_dtype)
            samples = [dataset[i] for i in next(iter(loader.batch_sampler), [])]
    except (IndexError, KeyError, TypeError, ValueError, StopIteration):   # the loop will tell
        return None
    return batch_to_device(loader.collate_fn(samples), batches.device, batches.float_dtype) if samples else None


@contextlib.contextmanager
def _generator_kept(sampler):
    """The state of a sampler's own torch.Generator, restored after the block."""
    generator = getattr(sampler, "generator", None)
    state = generator.get_state() if isinstance(generator, torch.Generator) else None
    try:
        yield
    finally:
        if state is not None:
            generator.set_state(state)


def batch_source(batches):
    """The batch source under step limits and sample weights (which keep the batches' form)."""
    while isinstance(batches, WrappedBatches):
        batches = batches.batches
    return batches
