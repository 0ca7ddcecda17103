"""A net's state dict as a list of numpy arrays, and weight files that a plain net loads: torch's (`torch.save` of
the state dict) or, for a path ending in `.safetensors`, the safetensors format Hugging Face and timm share (tensors
and their names only; the package is imported on use)."""
from __future__ import annotations

import os

import numpy as np
import torch

from easyfit.saving.checkpoint import FORMAT_KEY, as_data, load_data, save_file_atomically, write_atomically

SAFETENSORS_SUFFIX = ".safetensors"


def as_arrays(state: dict) -> list[np.ndarray]:
    """Copies of every entry of a state dict (parameters and buffers), in its order."""
    return [value.detach().cpu().numpy().copy() for value in state.values()]


def from_arrays(state: dict, weights: list) -> dict:
    """A state dict like `state` holding `weights` (in its order, each of its entry's shape; dtypes converted)."""
    if len(weights) != len(state):
        raise ValueError(f"set_weights expected a list of {len(state)} arrays (one per entry of the net's "
                         f"state_dict: {', '.join(state)}), received {len(weights)}")
    new_state = {}
    for (name, current), array in zip(state.items(), weights):
        value = torch.as_tensor(np.asarray(array))
        if tuple(value.shape) != tuple(current.shape):
            raise ValueError(f"set_weights: {name!r} expected shape {tuple(current.shape)}, "
                             f"received {tuple(value.shape)}")
        new_state[name] = value.to(current.dtype)
    return new_state


def save_state(state: dict, path: str | os.PathLike) -> None:
    """Write a state dict (on the CPU) atomically; `net.load_state_dict(torch.load(path))` reads it, or for a
    `.safetensors` path `safetensors.torch.load_file(path)`."""
    state = {key: value.detach().cpu() if isinstance(value, torch.Tensor) else value for key, value in state.items()}
    if is_safetensors(path):
        tensors = _safetensors_tensors(state)
        write_atomically(path, lambda temp_path: _safetensors().save_file(tensors, temp_path, {"format": "pt"}))
    else:
        save_file_atomically(path, as_data(state))


def read_state(path: str | os.PathLike, current: dict, trusted: bool = False) -> dict:
    """The state dict in a file written by `save_state` (or `torch.save(net.state_dict())`, or a safetensors file),
    or a checkpoint's, read as data (`trusted`: see checkpoint.load_data), after checking that it fits `current`
    (the net's state dict), so that a file that does not fit changes nothing."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"weights file {path!r} does not exist")
    if is_safetensors(path):
        try:
            state = _safetensors().load_file(path, device="cpu")
        except Exception as error:
            raise ValueError(f"{path!r} is not a safetensors file: {error}") from None
    else:
        state = load_data(path, "cpu", trusted)
    if isinstance(state, dict) and FORMAT_KEY in state:
        state = state["net"]
    if not isinstance(state, dict):
        raise TypeError(f"{path!r} holds a {type(state).__name__}, not a state dict; save it with "
                        "model.save_weights(path) or torch.save(net.state_dict(), path)")
    check_fits(current, state, f"load_weights({path!r})")
    return state


def is_safetensors(path: str | os.PathLike) -> bool:
    return os.fspath(path).lower().endswith(SAFETENSORS_SUFFIX)


def _safetensors():
    try:
        import safetensors.torch
    except ImportError:
        raise ImportError("weights files ending in .safetensors need safetensors: pip install easyfit[safetensors]"
                          ) from None
    return safetensors.torch


def _safetensors_tensors(state: dict) -> dict:
    """The state's tensors as safetensors stores them: contiguous, and a tensor that shares memory with an earlier
    entry (tied weights) copied, since the format holds each tensor once. Anything else is refused by name."""
    tensors, storages = {}, set()
    for key, value in state.items():
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"save_weights: the state dict's entry {key!r} is a {type(value).__name__}; a "
                            ".safetensors file holds tensors only (save to a .pt path instead)")
        value = value.contiguous()
        storage = value.untyped_storage().data_ptr()
        tensors[key] = value.clone() if storage in storages else value
        storages.add(storage)
    return tensors


def check_fits(current: dict, state: dict, call: str) -> None:
    """Raise, naming every difference, unless `state` has exactly the entries of `current`, each of its shape."""
    missing = [name for name in current if name not in state]
    unexpected = [name for name in state if name not in current]
    shapes = [f"{name}: the net has {tuple(current[name].shape)}, the file {tuple(value.shape)}"
              for name, value in state.items() if name in current and hasattr(value, "shape")
              and tuple(value.shape) != tuple(current[name].shape)]
    problems = [*([f"missing {', '.join(missing)}"] if missing else []),
                *([f"not in the net {', '.join(unexpected)}"] if unexpected else []), *shapes]
    if problems:
        raise ValueError(f"{call}: the weights do not fit this net, which is left unchanged ({'; '.join(problems)}). "
                         "Build the net as it was when the weights were saved (same layers and sizes).")
