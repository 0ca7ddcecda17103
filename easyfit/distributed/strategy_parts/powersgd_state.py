"""PowerSGD's state, saved and loaded per parameter, so that a resumed fit continues its compression exactly.

torch's `powerSGD_hook` keeps its error feedback and its warm-start P / Q memories per DDP bucket, as flat buffers in
the bucket's parameter order. DDP orders a bucket's parameters one way when it is built and another when it rebuilds
its buckets after a fit's first iteration, so a state saved by one fit does not fit the buckets of the next as it is.
`LaidOutPowerSGD` runs torch's hook and cuts the buffers into per-parameter pieces whenever a bucket's layout
changes (and for saving), then joins them again in the new layout.
"""
from __future__ import annotations

import math

import torch
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

from easyfit.saving.checkpoint import numpy_generator, numpy_generator_state

#: the fields of PowerSGD's state kept as they are (not per bucket); its numpy generator is saved as data apart
SCALAR_FIELDS = ("iter",)


class LaidOutPowerSGD:
    """torch's powerSGD_hook, tracking which parameters each bucket holds."""

    def __init__(self, state: powerSGD_hook.PowerSGDState, net: torch.nn.Module):
        self.state = state
        self.positions = {id(p): position for position, p in enumerate(net.parameters())}
        self.shapes = [p.shape for p in net.parameters()]
        self.layouts: dict[int, list[int]] = {}   # bucket index -> parameter positions, in bucket order
        self.loose: dict[int, dict[str, torch.Tensor]] = {}   # position -> its pieces, waiting for a bucket
        self.running: set[int] = set()   # buckets run in this iteration so far (their results may be in flight)

    def hook(self, state, bucket):
        """Register this bound method with DDP (`net.register_comm_hook(state, laid_out.hook)`)."""
        layout = [self.positions[id(p)] for p in bucket.parameters()]
        index = bucket.index()
        if self.layouts.get(index) != layout:   # first use, a rebuild of the buckets, or a loaded state
            self._cut(set(self.layouts) - self.running)   # only buffers at rest: not yet run in this iteration
            self._join(index, layout)
        self.running = set() if bucket.is_last() else self.running | {index}
        return powerSGD_hook.powerSGD_hook(state, bucket)

    # --- saving and loading -----------------------------------------------------------
    def state_dict(self) -> dict:
        """Between iterations (nothing in flight): the scalars and every parameter's pieces."""
        self._cut(set(self.layouts))
        return {**{name: getattr(self.state, name) for name in SCALAR_FIELDS},
                "rng": numpy_generator_state(self.state.rng), "pieces": dict(self.loose)}

    def load_state_dict(self, saved: dict) -> None:
        for name in SCALAR_FIELDS:
            setattr(self.state, name, saved[name])
        self.state.rng = numpy_generator(saved["rng"])
        self.state.error_dict.clear()
        self.state.p_memory_dict.clear()
        self.state.q_memory_dict.clear()
        self.layouts, self.loose, self.running = {}, dict(saved["pieces"]), set()

    # --- laying out -------------------------------------------------------------------
    def _sizes(self, layout: list[int]) -> dict[str, list[tuple[int, int]]]:
        """(position, length) of each parameter's piece in a bucket's flat buffers: the error feedback holds every
        parameter; P and Q hold those the hook compresses (as torch decides: matrices worth a low-rank form)."""
        rank, sizes = self.state.matrix_approximation_rank, {"error": [], "p": [], "q": []}
        for position in layout:
            shape = self.shapes[position]
            n, m = shape[0] if len(shape) else 1, math.prod(shape[1:])
            approximation = min(n, m, rank)
            sizes["error"].append((position, n * m))
            if powerSGD_hook._should_compress(n, m, approximation, self.state.min_compression_rate)[0]:
                sizes["p"].append((position, n * approximation))
                sizes["q"].append((position, m * approximation))
        return sizes

    def _buffers(self) -> dict[str, dict[int, torch.Tensor]]:
        state = self.state
        return {"error": state.error_dict, "p": state.p_memory_dict, "q": state.q_memory_dict}

    def _cut(self, indices: set[int]) -> None:
        """These buckets' buffers into per-parameter pieces (`loose`); the buckets then hold none."""
        for index in indices:
            for kind, pieces in self._sizes(self.layouts.pop(index)).items():
                buffer = self._buffers()[kind].pop(index, None)
                if buffer is None:
                    continue
                for (position, _), piece in zip(pieces, buffer.split([size for _, size in pieces])):
                    self.loose.setdefault(position, {})[kind] = piece.clone()

    def _join(self, index: int, layout: list[int]) -> None:
        """Bucket `index`'s buffers from the loose pieces of its parameters (where every piece is there)."""
        self.layouts[index] = layout
        for kind, pieces in self._sizes(layout).items():
            found = [self.loose.get(position, {}).get(kind) for position, _ in pieces]
            if pieces and all(piece is not None for piece in found):
                self._buffers()[kind][index] = torch.cat(found)
                for position, _ in pieces:
                    del self.loose[position][kind]

