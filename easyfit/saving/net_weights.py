"""A net's state dict as a list of numpy arrays, and weight files that a plain net loads."""
from __future__ import annotations

import os

import numpy as np
import torch

from easyfit.saving.checkpoint import FORMAT_KEY, save_file_atomically


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
    """Write a state dict (on the CPU) atomically; `net.load_state_dict(torch.load(path))` reads it."""
    save_file_atomically(path, {key: value.detach().cpu() for key, value in state.items()})


def read_state(path: str | os.PathLike) -> dict:
    """The state dict in a file written by `save_state` (or `torch.save(net.state_dict())`), or a checkpoint's."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"weights file {path!r} does not exist")
    state = torch.load(path, map_location="cpu", weights_only=False)
    if isinstance(state, dict) and FORMAT_KEY in state:
        state = state["net"]
    if not isinstance(state, dict):
        raise TypeError(f"{path!r} holds a {type(state).__name__}, not a state dict; save it with "
                        "model.save_weights(path) or torch.save(net.state_dict(), path)")
    return state
