"""The batch shapes a compiled step takes: the first batch's, with the dimensions seen to change between batches
compiled as dynamic.

Text, audio and graph models train on batches whose shapes change (sequences padded to each batch's longest). A
program compiled for the first batch's sizes would have to be compiled again for each new length, or leave the
batch to run eagerly. Instead, once a batch that is not an epoch's short last batch differs from the first in some
sizes (the same tensors, ranks, dtypes and devices), those dimensions are freed: the programs from then on are
compiled with them dynamic (Dynamo's `mark_dynamic`), once, for every length. A batch of another layout (more
tensors, another rank or dtype) runs eagerly, said once.
"""
from __future__ import annotations

import warnings

import torch
from torch.utils._pytree import tree_leaves

from easyfit.utils.torch_internals import mark_dynamic


def layout(shapes: tuple) -> list[tuple]:
    """(sizes, dtype, device) of each tensor in `functional_step.shapes_of`'s result, absent tensors left out."""
    return [(tuple(shape), dtype, device) for shape, dtype, device in (entry for entry in shapes if entry is not None)]


def tensors_of(*trees) -> list[torch.Tensor]:
    """The tensors of a batch, in `layout`'s order."""
    return [leaf for leaf in tree_leaves(trees) if isinstance(leaf, torch.Tensor)]


class ShapeFamily:
    """The first batch's layout and the dimensions (tensor index, dimension) freed since."""

    def __init__(self, first: tuple, may_free: bool = True):
        self.first = tuple(layout(first))
        self.may_free = may_free   # False: a change of size is recorded (`resized`), not compiled
        self.resized = False
        self.free: frozenset = frozenset()
        self.strangers: set = set()   # layouts that ran eagerly

    def takes(self, shapes: tuple, closing: bool | None) -> bool:
        """Whether a batch of `shapes` runs in this family's programs, freeing the dimensions it differs in unless
        it is an epoch's last batch (`closing`): a short last batch runs eagerly rather than make the batch
        dimension dynamic for the whole fit. `closing` None (where the position is unknown): a batch whose batch size
        differs runs eagerly (a short last batch), and only other dimensions are freed."""
        found = layout(shapes)
        if not self._same_layout(found):
            self._stranger(shapes)
            return False
        changed = {(index, dim) for index, (first, now) in enumerate(zip(self.first, found))
                   for dim, (size, new) in enumerate(zip(first[0], now[0])) if size != new}
        if changed <= self.free:
            return True
        if closing or closing is None and any(dim == 0 for _, dim in changed - self.free):
            return False
        if not self.may_free:
            self.resized = True
            return False
        self.free = self.free | changed
        return True

    def mark(self, *trees) -> None:
        """Mark the free dimensions of a batch's tensors dynamic for torch.compile."""
        if self.free:
            tensors = tensors_of(*trees)
            for index, dim in self.free:
                mark_dynamic(tensors[index], dim)

    def _same_layout(self, found: list) -> bool:
        return len(found) == len(self.first) and all(
            len(now[0]) == len(first[0]) and now[1:] == first[1:] for first, now in zip(self.first, found))

    def _stranger(self, shapes: tuple) -> None:
        if len(self.strangers) < 2:
            self.strangers.add(shapes)
            if len(self.strangers) == 2:
                warnings.warn("compile=: batches come in several layouts (other tensors, ranks or dtypes than the "
                              "first batch's); each batch of another layout runs eagerly", stacklevel=4)
