"""A net's weights as a list of numpy arrays, and weight files that a plain net loads."""
from __future__ import annotations

import os

import numpy as np
import torch
from torch import nn

from easyfit.checkpoint import FORMAT_KEY, save_file_atomically


def get_weights(net: nn.Module) -> list[np.ndarray]:
    """Copies of every entry of `net.state_dict()` (parameters and buffers), in its order."""
    return [value.detach().cpu().numpy().copy() for value in net.state_dict().values()]


def set_weights(net: nn.Module, weights: list) -> None:
    """Load arrays in `net.state_dict()` order; each must have its entry's shape (dtypes are converted)."""
    state = net.state_dict()
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
    net.load_state_dict(new_state)


def save_weights(net: nn.Module, path: str | os.PathLike) -> None:
    """Write `net.state_dict()` atomically; `net.load_state_dict(torch.load(path))` reads it."""
    save_file_atomically(path, {key: value.detach().cpu() for key, value in net.state_dict().items()})


def load_weights(net: nn.Module, path: str | os.PathLike) -> None:
    """Load a file written by `save_weights` (or `torch.save(net.state_dict())`), or the net of a checkpoint."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"weights file {path!r} does not exist")
    state = torch.load(path, map_location="cpu", weights_only=False)
    if isinstance(state, dict) and FORMAT_KEY in state:
        state = state["net"]
    if not isinstance(state, dict):
        raise TypeError(f"{path!r} holds a {type(state).__name__}, not a state dict; save it with "
                         "model.save_weights(path) or torch.save(net.state_dict(), path)")
    net.load_state_dict(state)
