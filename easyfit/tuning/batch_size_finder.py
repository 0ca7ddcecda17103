"""model.find_batch_size: the largest per-process batch that trains.

Each process searches on its own device with trial fits of a few steps (doubling the batch from `start`, then a
binary search between the last size that trained and the first that did not): a size fails when it runs out of
memory (CUDA's out-of-memory error, or a CPU allocation that fails) or when its peak memory exceeds `max_memory`.
The processes then agree on the smallest answer. On the CPU, without `max_memory`, the budget is a share of the
memory the machine has free (easyfit.tuning.memory_budget), said in one line. The trials run eagerly and one process
at a time per device, with everything they change undone (easyfit.tuning.trial).
"""
from __future__ import annotations

import gc
import os
import sys
from dataclasses import dataclass
from typing import Any, Callable

import torch

from easyfit.data.batches import check_not_empty
from easyfit.distributed.run_options import RunOptions, option_names
from easyfit.distributed.strategies.single import SingleDeviceStrategy
from easyfit.training.call_kind import CallKind
from easyfit.training.fit_options import fit_option_names
from easyfit.tuning.memory_budget import can_measure, default_budget
from easyfit.tuning.trial import undone_afterwards
from easyfit.utils.checks import check_positive_int
from easyfit.utils.options import refuse_unknown
from easyfit.utils.tensors import sample_count

#: what a failed allocation says on the CPU (torch raises a plain RuntimeError there)
CPU_OUT_OF_MEMORY = ("can't allocate memory", "out of memory")
#: fit options a trial sets itself
TRIAL_OPTIONS = ("epochs", "batch_size", "steps_per_epoch", "validation_data", "validation_split", "resume_from",
                 "shuffle", "verbose", "lr_scaling")


def largest_that_trains(trains: Callable[[int], bool], start: int, limit: int) -> int:
    """The largest size in [start, limit] for which `trains(size)` holds, assuming every smaller size trains too:
    doubling from `start` until a size fails, then a binary search below it."""
    if not trains(start):
        raise RuntimeError(f"not even a batch of {start} trains on this device (out of memory or over max_memory); "
                           "use a smaller start, a smaller net, or a larger memory budget")
    good, bad = start, None
    while bad is None:
        larger = min(good * 2, limit)
        if larger == good:
            return good
        good, bad = (larger, None) if trains(larger) else (good, larger)
    while bad - good > 1:
        middle = (good + bad) // 2
        good, bad = (middle, bad) if trains(middle) else (good, middle)
    return good


def is_out_of_memory(error: BaseException | None) -> bool:
    """Whether `error`, or an error it was raised from, says that memory ran out."""
    for _ in range(8):   # the chain of causes (easyfit's data checks re-raise with an explanation)
        if error is None:
            return False
        if isinstance(error, torch.OutOfMemoryError) or (
                isinstance(error, RuntimeError) and any(words in str(error) for words in CPU_OUT_OF_MEMORY)):
            return True
        error = error.__cause__ or error.__context__
    return False


class PeakMemory:
    """Peak memory of one trial on `device`: CUDA's allocated bytes, or this process's peak resident set (Linux)."""

    def __init__(self, device: torch.device):
        self.device = device

    def reset(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            return
        try:
            with open("/proc/self/clear_refs", "w") as clear:
                clear.write("5")   # resets the peak resident set size (VmHWM) to the current one
        except OSError as error:
            raise RuntimeError(f"max_memory on the CPU needs to reset this process's peak memory through "
                               f"/proc/self/clear_refs, which failed ({error}); give max_batch_size instead") from None

    def peak(self) -> int:
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device)
        with open("/proc/self/status") as status:
            kilobytes = next(line.split()[1] for line in status if line.startswith("VmHWM:"))
        return int(kilobytes) * 1024


def check_search(x, start: int, max_batch_size: int | None, max_memory: int | None, steps: int,
                 options: dict, accelerator: Any) -> int:
    """Raise before any trial on a bad argument; the largest size the data allows."""
    check_positive_int(start, "start")
    check_positive_int(steps, "steps")
    if max_batch_size is not None:
        check_positive_int(max_batch_size, "max_batch_size", "a positive integer or None")
    if max_memory is not None:
        check_positive_int(max_memory, "max_memory", "a number of bytes or None")
        if sys.platform != "linux" and accelerator not in ("cuda", "gpu"):   # CUDA counts its own bytes
            raise ValueError("max_memory on the CPU reads the process's peak memory from /proc, which only Linux has")
    taken = sorted(set(options) & set(TRIAL_OPTIONS))
    if taken:
        raise TypeError(f"find_batch_size runs its own short trials; it takes no {', '.join(taken)}")
    samples = _sample_count(x)
    check_not_empty(samples)
    return min(samples, max_batch_size or samples)


def _sample_count(x) -> int:
    first = x[0] if isinstance(x, (list, tuple)) else x
    if not hasattr(first, "__len__") or isinstance(first, torch.utils.data.DataLoader):
        raise TypeError("find_batch_size batches the data itself: pass arrays, tensors or a Dataset, not "
                        f"{type(x).__name__}")
    return sample_count(x)


@dataclass(frozen=True)
class Search:
    """A search's bounds (checked by `find_batch_size`), its trials' steps and the fit options they train with."""
    start: int
    limit: int
    max_memory: int | None
    steps: int
    fit_options: dict


def search_on_rank(model, run: RunOptions, x, y, options: Search) -> int:
    """On this rank: the search on its own device, then the smallest answer of all ranks."""
    start, limit, max_memory, steps = options.start, options.limit, options.max_memory, options.steps
    strategy = model.strategy
    device = strategy.root_device
    memory, samples = PeakMemory(device), _sample_count(x)
    if max_memory is None and device.type == "cpu" and can_measure():
        max_memory = _default_budget(strategy)

    def trains(batch_size: int) -> bool:
        if max_memory is not None:
            memory.reset()
        try:
            with undone_afterwards(model):
                model.fit(x, y, epochs=1, batch_size=batch_size, steps_per_epoch=min(steps, -(-samples // batch_size)),
                          shuffle=False, verbose=0, lr_scaling=None, strategy=SingleDeviceStrategy(device), devices=1,
                          accelerator=device.type, precision=run.precision, **options.fit_options)
        except Exception as error:   # anything but running out of memory is raised again
            if not is_out_of_memory(error):
                raise
            fits = False
        else:
            fits = max_memory is None or memory.peak() <= max_memory
        if not fits and device.type == "cuda":   # the failed trial's blocks back to the device for the next
            gc.collect()
            torch.cuda.empty_cache()
        return fits

    answer = largest_that_trains(trains, start, limit)   # each trial's call puts this call back on the Model
    return int(strategy.reduce(torch.tensor([answer], device=device), "min").item())


FIND_BATCH_SIZE = CallKind("find_batch_size", search_on_rank)


def _default_budget(strategy) -> int:
    """The CPU budget of every rank when none was given (the smallest rank's), said on global rank 0."""
    processes = int(os.environ.get("LOCAL_WORLD_SIZE", 0)) or getattr(strategy, "num_processes", 1)
    budget, words = default_budget(processes)
    budget = int(strategy.reduce(torch.tensor([budget], device=strategy.root_device), "min").item())
    if strategy.is_global_zero:
        print(f"find_batch_size on the CPU: {words}", flush=True)
    return budget


def find_batch_size(model, x, y, *, start: int, max_batch_size: int | None, max_memory: int | None, steps: int,
                    **kwargs) -> int:
    """See Model.find_batch_size (its defaults)."""
    run_kwargs = {key: value for key, value in kwargs.items() if key in option_names()}
    options = {key: value for key, value in kwargs.items() if key not in run_kwargs}
    limit = check_search(x, start, max_batch_size, max_memory, steps, options, run_kwargs.get("accelerator"))
    refuse_unknown(options, fit_option_names())   # a misspelt option is refused by name before any trial
    accelerator = run_kwargs.get("accelerator", "auto")
    on_gpu = accelerator in ("cuda", "gpu") or (accelerator == "auto" and torch.cuda.is_available())
    if max_memory is None and max_batch_size is None and not on_gpu and not can_measure():
        raise ValueError("on the CPU, running out of memory ends the process instead of raising, and the memory free "
                         "cannot be read here (Linux's /proc) to choose a budget: give find_batch_size max_memory "
                         "(bytes of peak memory per process) or max_batch_size")
    run = RunOptions(**run_kwargs)
    return model._dispatch(FIND_BATCH_SIZE, run, x, y, Search(start, limit, max_memory, steps, options))
