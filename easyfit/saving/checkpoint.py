"""Checkpoint files: written atomically (temp file, fsync, rename), holding data only, and read as data.

Every file easyfit writes holds only what `torch.load(weights_only=True)` reads: tensors, numbers, strings, bytes,
lists, tuples and dicts (plus torch.Size, dtypes and devices). `as_data` enforces that before anything is written,
so a state added to a checkpoint later follows the same rule. Every file easyfit reads is read with
`weights_only=True`: unpickling any other object can run code the file carries, so a file that needs more is refused
with `UntrustedCheckpointError`, unless the caller passes `trusted=True` for a file it trusts.
"""
from __future__ import annotations

import os
import pickle
import re
import tempfile
from collections import OrderedDict
from typing import Callable

import numpy as np
import torch

FORMAT_KEY = "easyfit_checkpoint"
FORMAT_VERSION = 1
#: the key of easyfit's state in a DeepSpeed checkpoint's client state
DEEPSPEED_CLIENT_KEY = "easyfit"
#: the file beside a sharded FSDP checkpoint's shards that holds the rest of the state
FSDP_META_FILE = "easyfit_meta.pt"
#: what a checkpoint may hold besides tensors, lists, tuples and dicts
PLAIN_TYPES = (type(None), bool, int, float, complex, str, bytes, torch.Size, torch.dtype, torch.device)
TRUSTED_OPT_IN = ("If the file comes from a source you trust (e.g. a checkpoint written by an easyfit from before "
                  "checkpoints were data only, which could hold numpy values), pass trusted=True where you load it: "
                  "Model.load(path, net, trusted=True) or model.load_weights(path, trusted=True); to resume it with "
                  "fit(resume_from=...), rewrite it as data once with easyfit.checkpoint_convert."
                  "convert_checkpoint(path, new_path, trusted=True) (python -m easyfit.checkpoint_convert PATH "
                  "NEW_PATH --trusted) and resume from the new file.")


class UntrustedCheckpointError(ValueError):
    """A file holds objects that only unpickling reads, and the caller did not say it trusts the file."""


def as_data(value, where: str = "the checkpoint"):
    """`value` as a checkpoint may hold it: numpy scalars become Python numbers and numpy arrays tensors (nothing
    is copied when nothing changes). Raises TypeError naming the first entry that is none of those, before any
    file is written."""
    kind = type(value)
    if kind in PLAIN_TYPES or kind in (torch.Tensor, torch.nn.Parameter):
        return value
    if isinstance(value, np.generic):
        return as_data(value.item(), where)
    if kind is np.ndarray and value.dtype.kind in "biufc":   # booleans and numbers
        return torch.from_numpy(value.copy())
    if kind is np.random.RandomState:   # e.g. PowerSGD's, in a file written before states were data
        return numpy_generator_state(value)
    if kind in (dict, OrderedDict):
        items = [(as_data(key, f"a key of {where}"), as_data(entry, f"{where}[{key!r}]"))
                 for key, entry in value.items()]
        if all(new[0] is old[0] and new[1] is old[1] for new, old in zip(items, value.items())):
            return value
        converted = kind(items)
        if kind is OrderedDict:
            vars(converted).update(vars(value))   # a state dict's _metadata
        return converted
    if kind in (list, tuple):
        entries = [as_data(entry, f"{where}[{index}]") for index, entry in enumerate(value)]
        return value if all(new is old for new, old in zip(entries, value)) else kind(entries)
    raise TypeError(f"{where} is a {kind.__module__}.{kind.__qualname__}: a checkpoint holds data only (tensors, "
                    "numbers, strings, lists, tuples and dicts), so that loading it can never run code. Give that "
                    "state as such values (e.g. a callback's state_dict() returning plain numbers and lists).")


def numpy_generator_state(rng: np.random.RandomState) -> dict:
    """A numpy RandomState's state as data (its Mersenne Twister key as a tensor)."""
    kind, key, position, has_gauss, cached_gaussian = rng.get_state()
    return {"kind": kind, "key": torch.from_numpy(key.astype(np.int64)), "position": int(position),
            "has_gauss": int(has_gauss), "cached_gaussian": float(cached_gaussian)}


def numpy_generator(state) -> np.random.RandomState:
    """The RandomState whose state `numpy_generator_state` gave (or the object itself, from a trusted older file)."""
    if isinstance(state, np.random.RandomState):
        return state
    rng = np.random.RandomState()
    rng.set_state((state["kind"], state["key"].cpu().numpy().astype(np.uint32), state["position"],
                   state["has_gauss"], state["cached_gaussian"]))
    return rng


def save_checkpoint_file(path: str | os.PathLike, state: dict) -> None:
    """Write `state` to `path` so that a crash mid-write never leaves a truncated file behind."""
    save_file_atomically(path, as_data({FORMAT_KEY: FORMAT_VERSION, **state}))


def save_file_atomically(path: str | os.PathLike, obj) -> None:
    """`torch.save(obj)` to a temporary file in the same folder, flushed, then renamed over `path`."""
    write_atomically(path, lambda temp_path: torch.save(obj, temp_path))


def write_atomically(path: str | os.PathLike, write: Callable[[str], None]) -> None:
    """`write(temp_path)` writes a temporary file in the same folder (with `path`'s suffix), which is flushed to
    disk, then renamed over `path`; on any failure it is removed and `path` is left as it was."""
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    handle, temp_path = tempfile.mkstemp(prefix=".tmp-", suffix=os.path.splitext(path)[1] or ".pt", dir=directory)
    try:
        os.close(handle)
        os.chmod(temp_path, 0o666 & ~_umask())   # as an ordinary new file, not mkstemp's owner-only 0600
        write(temp_path)
        with open(temp_path, "rb+") as file:
            os.fsync(file.fileno())
        os.replace(temp_path, path)
    except BaseException:
        if os.path.exists(temp_path):
            os.remove(temp_path)
        raise


def load_data(path: str | os.PathLike, map_location=None, trusted: bool = False, allowed: tuple = (), **options):
    """`torch.load(path)` as data (`weights_only=True`, with the classes `allowed` too: a backend's plain records);
    with `trusted`, any pickled object (only for a file the caller trusts). A file that needs more raises
    UntrustedCheckpointError, which says why and names the opt-in."""
    try:
        with torch.serialization.safe_globals(list(allowed)):
            return torch.load(path, map_location=map_location, weights_only=not trusted, **options)
    except pickle.UnpicklingError as error:
        if trusted or "weights only load failed" not in str(error).lower():
            raise
        if "Unsupported operand" in str(error):   # no pickle at all (a text file), or a damaged one
            raise pickle.UnpicklingError(f"{os.fspath(path)!r} is not a file torch.save wrote, or it is damaged "
                                         f"({refused_object(error)})") from None
        raise untrusted(path, refused_object(error)) from None


def untrusted(path: str | os.PathLike, refused: str) -> UntrustedCheckpointError:
    """The error for a file that holds `refused`, something other than data."""
    return UntrustedCheckpointError(
        f"{os.fspath(path)!r} holds more than data ({refused}). easyfit reads files as data only "
        "(torch.load(weights_only=True): tensors, numbers, strings, lists and dicts), because unpickling any other "
        f"object can run code hidden in the file; nothing in it was run. {TRUSTED_OPT_IN}")


def refused_object(error: Exception) -> str:
    """What torch's weights-only unpickler refused, in a few words."""
    named = re.search(r"Unsupported global: GLOBAL (\S+)", str(error))
    if named:
        return f"it names {named.group(1)}, which is not data"
    found = re.search(r"WeightsUnpickler error:\s*([^\n]+)", str(error))
    return found.group(1).strip().rstrip(".") if found else "an object other than data"


def load_checkpoint_file(path: str | os.PathLike, map_location=None, trusted: bool = False) -> dict:
    """Read a checkpoint written by `save_checkpoint_file`, as data (`trusted`: see `load_data`); clear errors for
    a missing, foreign or untrusted file."""
    path = os.fspath(path)
    if os.path.isdir(path):
        raise ValueError(f"{path!r} is a directory, e.g. a sharded checkpoint (state_dict_type='sharded'): resume it "
                         "with fit(resume_from=...) under the strategy that wrote it, or turn it into one file: "
                         f"python -m easyfit.checkpoint_convert {path} checkpoint.pt")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"checkpoint {path!r} does not exist; check the path "
                                "(ModelCheckpoint and model.save write the files easyfit can resume from)")
    try:
        state = load_data(path, map_location, trusted)
    except UntrustedCheckpointError:
        raise
    except Exception as error:
        raise ValueError(f"{path!r} is not an easyfit checkpoint: it could not be read by torch.load "
                         f"({error})") from None
    if not isinstance(state, dict) or FORMAT_KEY not in state:
        raise ValueError(f"{path!r} is not an easyfit checkpoint (it has no {FORMAT_KEY!r} marker). "
                         "Load plain state dicts with net.load_state_dict(torch.load(path)) instead.")
    return state


def _umask() -> int:
    """The process's file-creation mask (reading it means setting it, so it is set straight back)."""
    mask = os.umask(0)
    os.umask(mask)
    return mask
