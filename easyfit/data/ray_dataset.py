"""A `ray.data.Dataset` (or a Ray Train worker's shard of one) as a batch source. Ray is imported only where one is
given.

Each row is a dict of columns: the target is the column "y" (else "label", "labels" or "target"); the inputs are the
column "x", else the other columns (one: the net's input; several: a dict the net takes by name). predict ignores a
target column.

- Training data is streamed as it comes: under `launcher="ray"` each worker streams the shard Ray Train gives it
  (`get_dataset_shard`, equal shares), as it does a shard given in a user's own train function; easyfit's `shuffle`
  and `seed` leave Ray's order alone (shuffle in Ray Data).
- A whole Dataset (evaluation and prediction data; training data outside launcher="ray") is read in order (Ray Data's
  `preserve_order`), and worker r of W keeps the rows r, r+W, r+2W, ... as easyfit's own evaluation shares do:
  evaluate is exact and predict returns every row in order.
"""
from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from easyfit.data.arrays import batch_to_device
from easyfit.data.source import BatchSource

TARGETS = ("y", "label", "labels", "target")
#: the training dataset's name in Ray Train's `datasets` (split by Ray Train into the workers' shards)
TRAIN_NAME = "train"


def is_ray_data(x: Any) -> bool:
    """A Ray Dataset or a Ray Train shard (a DataIterator); read from the type, without importing Ray."""
    kind = type(x)
    return kind.__module__.startswith("ray.data") and kind.__name__ in (
        "Dataset", "MaterializedDataset", "DataIterator", "StreamSplitDataIterator", "_IterableFromIterator")


class TrainShard:
    """Stands for the training dataset in the call a worker of `launcher="ray"` runs: its shard, from Ray Train."""

    def shard(self):
        import ray.train
        return ray.train.get_dataset_shard(TRAIN_NAME)


def hand_to_ray(inputs: dict, training: bool) -> tuple[dict, dict | None, Any]:
    """The caller's side of `launcher="ray"`: a fit's (`training`) dataset goes to Ray Train (which splits it
    between the workers); the inputs keep a `TrainShard` in its place. (inputs, Ray Train's datasets, its
    DataConfig)."""
    if not (training and is_ray_data(inputs.get("x"))):
        return inputs, None, None
    from ray.train import DataConfig
    return {**inputs, "x": TrainShard()}, {TRAIN_NAME: inputs["x"]}, DataConfig(datasets_to_split=[TRAIN_NAME])


def worker_inputs(inputs: dict) -> dict:
    """A worker's side: the training shard Ray Train made for this worker."""
    if isinstance(inputs.get("x"), TrainShard):
        return {**inputs, "x": inputs["x"].shard()}
    return inputs


class RayBatches(BatchSource):
    """The batches of a Ray Dataset (see the module docstring); `len()` is unknown (a stream)."""

    def __init__(self, data, batch_size: int, device: torch.device, float_dtype: torch.dtype, train: bool,
                 targets: bool, rank: int = 0, world_size: int = 1):
        self.whole = hasattr(data, "streaming_split")   # a Dataset, not a worker's shard of one
        super().__init__(sharded=not train and world_size > 1 and self.whole)
        self.data, self.batch_size, self.device, self.float_dtype = data, batch_size, device, float_dtype
        self.train, self.targets, self.rank, self.world_size = train, targets, rank, world_size

    def set_epoch(self, epoch: int) -> None:
        """Ray Data orders (or shuffles) each epoch itself."""

    def __len__(self) -> int:
        raise TypeError("a Ray Dataset is streamed: its number of batches is not known ahead")

    def __iter__(self) -> Iterator[Any]:
        for columns in self._read():
            if columns and len(next(iter(columns.values()))):
                yield batch_to_device(structured(columns, self.targets), self.device, self.float_dtype)

    def _read(self) -> Iterator[dict]:
        if not self.whole:   # a worker's shard: as Ray Train streams it
            yield from self.data.iter_batches(batch_size=self.batch_size, batch_format="numpy")
            return
        # in order, in batches of batch_size rows a worker; worker r keeps rows r, r+W, ... (each batch starts at a
        # multiple of W)
        from ray.data import DataContext
        context = DataContext.get_current()
        kept, context.execution_options.preserve_order = context.execution_options.preserve_order, True
        try:
            for columns in self.data.iter_batches(batch_size=self.batch_size * self.world_size,
                                                  batch_format="numpy"):
                yield {name: values[self.rank::self.world_size] for name, values in columns.items()}
        finally:
            context.execution_options.preserve_order = kept


def structured(columns: dict, targets: bool) -> tuple:
    """A batch of columns as the loop takes it: (inputs, target) or, without targets, (inputs,)."""
    target = next((name for name in TARGETS if name in columns), None)
    if targets and target is None:
        raise ValueError(f"a Ray Dataset to train or evaluate on needs a target column named one of "
                         f"{', '.join(TARGETS)}; its columns are {', '.join(columns)}")
    rest = {name: values for name, values in columns.items() if name != target}
    if not rest:
        raise ValueError(f"the Ray Dataset has no input column beside its target {target!r}")
    inputs = rest["x"] if "x" in rest else next(iter(rest.values())) if len(rest) == 1 else rest
    return (inputs, columns[target]) if targets else (inputs,)
