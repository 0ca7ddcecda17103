"""Checkpoint files: written atomically (temp file, fsync, rename), checked on load."""
from __future__ import annotations

import os
import tempfile

import torch

FORMAT_KEY = "easyfit_checkpoint"
FORMAT_VERSION = 1
#: the key of easyfit's state in a DeepSpeed checkpoint's client state
DEEPSPEED_CLIENT_KEY = "easyfit"
#: the file beside a sharded FSDP checkpoint's shards that holds the rest of the state
FSDP_META_FILE = "easyfit_meta.pt"


def save_checkpoint_file(path: str | os.PathLike, state: dict) -> None:
    """Write `state` to `path` so that a crash mid-write never leaves a truncated file behind."""
    save_file_atomically(path, {FORMAT_KEY: FORMAT_VERSION, **state})


def save_file_atomically(path: str | os.PathLike, obj) -> None:
    """`torch.save(obj)` to a temporary file in the same folder, flushed, then renamed over `path`."""
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    handle, temp_path = tempfile.mkstemp(prefix=".tmp-", suffix=".pt", dir=directory)
    try:
        os.chmod(temp_path, 0o666 & ~_umask())   # as an ordinary new file, not mkstemp's owner-only 0600
        with os.fdopen(handle, "wb") as file:
            torch.save(obj, file)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temp_path, path)
    except BaseException:
        if os.path.exists(temp_path):
            os.remove(temp_path)
        raise


def load_checkpoint_file(path: str | os.PathLike, map_location=None) -> dict:
    """Read a checkpoint written by `save_checkpoint_file`; clear errors for a missing or foreign file."""
    path = os.fspath(path)
    if os.path.isdir(path):
        raise ValueError(f"{path!r} is a directory, e.g. a sharded checkpoint (state_dict_type='sharded'): resume it "
                         "with fit(resume_from=...) under the strategy that wrote it, or turn it into one file: "
                         f"python -m easyfit.saving.convert {path} checkpoint.pt")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"checkpoint {path!r} does not exist; check the path "
                                "(ModelCheckpoint and model.save write the files easyfit can resume from)")
    try:
        state = torch.load(path, map_location=map_location, weights_only=False)
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
