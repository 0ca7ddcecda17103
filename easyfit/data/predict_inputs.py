"""What predict passes to the net from each batch."""
from __future__ import annotations

import inspect
import math
from typing import Any

import torch

from easyfit.data.contents import split_batch


class PredictInputs:
    """What predict passes to the net from a batch: all of it, as there are no targets unless the user names them.
    A tensor is the input; a tuple or list is the net's positional inputs ((x,), (x, mask)); a dict loses only a
    target key it names ("y", "target", "label", ...). Only a tuple that the net's forward cannot take whole, but
    can take less its last element ((x, y) for forward(x)), is split as in training. A tuple that fits neither way
    is an error."""

    def __init__(self, net: torch.nn.Module):
        self.net_name = type(net).__name__
        self.signature, self.counts = forward_inputs(net)

    def __call__(self, batch: Any) -> Any:
        if isinstance(batch, dict):
            return split_batch(batch)[0]
        if not isinstance(batch, (tuple, list)) or not batch:
            return batch
        if len(batch) == 1:   # (x,), or ((x1, x2),): one batch of several in-memory inputs
            inputs = batch[0]
            if isinstance(inputs, tuple) and self.counts is not None and not self._fits(len(inputs)):
                raise ValueError(
                    f"predict got {len(inputs)} inputs per batch (a list or tuple of arrays holds one array per "
                    f"input of the net, as in Keras), but {self.net_name}.forward{self.signature} does not take "
                    f"{len(inputs)}. To predict over a list of batches, make each a tuple, [(x_batch,), ...], or "
                    "pass a DataLoader.")
            return inputs
        if self.counts is None or self._fits(len(batch)):
            return tuple(batch)
        if not self._fits(len(batch) - 1):
            raise ValueError(
                f"predict got batches of {len(batch)} tensors, but {self.net_name}.forward{self.signature} takes "
                f"neither {len(batch)} inputs nor {len(batch) - 1} (the batch less a target). Pass batches that "
                "hold the net's inputs, e.g. predict([x1, x2]) for a net with two inputs.")
        return split_batch(batch)[0]

    def _fits(self, count: int) -> bool:
        required, most = self.counts
        return required <= count <= most


def forward_inputs(net: torch.nn.Module) -> tuple[str, tuple[int, float] | None]:
    """(the forward's signature as text, (required, most) positional inputs it takes), or ("(...)", None)."""
    try:
        signature = inspect.signature(net.forward)
    except (TypeError, ValueError):
        return "(...)", None
    kinds = [p for p in signature.parameters.values()
             if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL)]
    required = sum(p.default is p.empty and p.kind != p.VAR_POSITIONAL for p in kinds)
    most = math.inf if any(p.kind == p.VAR_POSITIONAL for p in kinds) else len(kinds)
    return str(signature), (required, most)
