"""Checkpoint files: written atomically (temp file, fsync, rename), holding data only, and read as data.

Every file easyfit writes holds only what `torch.load(weights_only=True)` reads: tensors, numbers, strings, bytes,
lists, tuples and dicts (plus torch.Size, dtypes and devices). `as_data` enforces that before anything is written,
so a state added to a checkpoint later follows the same rule. Every file easyfit reads is read with
`weights_only=True`: unpickling any other object can run code the file carries, so a file that needs more is refused
with `UntrustedCheckpointError`, unless the caller passes `trusted=True` for a file it trusts.
"""
from __future__ import annotations

import contextlib
import os
import pickle
import re
import socket
import tempfile
import zlib
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
#: the longest file name a temporary file's name holds as it is (a longer one by its hash)
MAX_NAME_IN_TEMP = 120
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


class DamagedFileError(ValueError):
    """A file torch.load cannot read as torch.save writes one: cut short (a copy or download that stopped), damaged,
    empty, or never such a file."""


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
    """`write(temp_path)` writes a temporary file in the same folder (named by `temp_prefix`, with `path`'s suffix),
    which is flushed to disk, then renamed over `path`; on any failure it is removed and `path` is left as it was.
    What a killed writer of `path` left is removed first (`remove_leftovers`)."""
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    remove_leftovers(path)
    handle, temp_path = tempfile.mkstemp(prefix=temp_prefix(path), suffix=_temp_suffix(path), dir=directory)
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


def temp_prefix(path: str, pid: int | None = None) -> str:
    """The name a temporary file of `path` starts with: `.tmp-<file name>.<this machine>.<process id>.` (a long
    name by its hash), so that its leftovers are known as this target's and their writer can be checked."""
    name = os.path.basename(path)
    name = name if len(name) <= MAX_NAME_IN_TEMP else f"{zlib.crc32(name.encode()):08x}"
    return f".tmp-{name}.{_machine()}.{os.getpid() if pid is None else pid}."


def remove_leftovers(path: str | os.PathLike) -> None:
    """Remove the temporary files of `path` that a process killed while writing it left beside it: only easyfit's
    own (`temp_prefix`) for this target, and only those written on this machine by a process that has ended."""
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    start = temp_prefix(path, pid=0)[:-2]   # up to the process id
    try:
        names = [name for name in os.listdir(directory) if name.startswith(start)]
    except OSError:   # no folder (yet), or not one this process may read
        return
    own = re.compile(re.escape(start) + r"(\d+)\.[a-z0-9_]{8}" + re.escape(_temp_suffix(path)) + "$")
    for name in names:
        writer = own.match(name)
        if writer and not _running(int(writer.group(1))):
            with contextlib.suppress(FileNotFoundError):   # another process removed it first
                os.remove(os.path.join(directory, name))


def _temp_suffix(path: str) -> str:
    return os.path.splitext(path)[1] or ".pt"


def _machine() -> str:
    """This machine, in 8 hex digits (its host name's hash): a process id only names a process on its machine."""
    return f"{zlib.crc32(socket.gethostname().encode()):08x}"


def _running(pid: int) -> bool:
    """Whether process `pid` of this machine runs (this one does; where that cannot be told, it does). One that has
    ended but that its parent has not reaped yet (a killed rank whose caller was killed too) does not."""
    if pid == os.getpid() or os.name != "posix":
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:   # another user's process
        return True
    return not _ended_unreaped(pid)


def _ended_unreaped(pid: int) -> bool:
    """Whether process `pid` has ended and waits for its parent to reap it (a zombie: Linux's /proc says so;
    where there is no /proc, no)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as stat:
            return stat.read().rpartition(")")[2].split()[:1] == ["Z"]
    except OSError:
        return False


def load_data(path: str | os.PathLike, map_location=None, trusted: bool = False, allowed: tuple = (), **options):
    """`torch.load(path)` as data (`weights_only=True`, with the classes `allowed` too: a backend's plain records);
    with `trusted`, any pickled object (only for a file the caller trusts). A file that needs more raises
    UntrustedCheckpointError, which says why and names the opt-in; one whose bytes it cannot read (cut short)
    DamagedFileError. What a killed writer of `path` left beside it is removed (`remove_leftovers`)."""
    if isinstance(path, (str, os.PathLike)):
        remove_leftovers(path)
    try:
        with torch.serialization.safe_globals(list(allowed)):
            return torch.load(path, map_location=map_location, weights_only=not trusted, **options)
    except (RuntimeError, EOFError, OSError) as error:
        if not is_damaged(error):
            raise
        raise damaged(path, error) from None
    except pickle.UnpicklingError as error:
        if trusted or "weights only load failed" not in str(error).lower():
            raise
        if "Unsupported operand" in str(error):   # no pickle at all (a text file), or a damaged one
            raise pickle.UnpicklingError(f"{os.fspath(path)!r} is not a file torch.save wrote, or it is damaged "
                                         f"({refused_object(error)})") from None
        raise untrusted(path, refused_object(error)) from None


def is_damaged(error: Exception) -> bool:
    """Whether torch.load's `error` says the file's bytes are wrong (its zip archive or pickle cut short or broken),
    rather than that the file could not be opened or its tensors not be placed."""
    if isinstance(error, (FileNotFoundError, PermissionError, IsADirectoryError)):
        return False
    return isinstance(error, (EOFError, OSError)) or "PytorchStreamReader" in str(error)


def damaged(path: str | os.PathLike, error: Exception) -> DamagedFileError:
    """The error for a file whose bytes torch.load cannot read, naming it, its size and torch's reason."""
    path = os.fspath(path)
    size = os.path.getsize(path)
    what = "it is empty" if size == 0 else f"its {size} bytes are cut short or damaged, or it is not a file " \
        "torch.save wrote"
    reason = str(error).strip().split(". ")[0] or type(error).__name__
    return DamagedFileError(f"{path!r} cannot be read: {what} (torch.load: {reason}). A file easyfit writes is "
                            "complete or absent (written to a temporary file, then renamed), so this one was cut "
                            "short or changed after it was written (e.g. a copy or download that stopped): copy or "
                            "write it again.")


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
    except (UntrustedCheckpointError, DamagedFileError):
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
