"""A compiled CPU program's float32 matrix products through oneDNN where oneDNN is faster on this machine.

torch's CPU `mm` calls MKL, which runs a slower code path on CPUs that are not Intel's: on an AMD EPYC with
AVX-512, one core does 110 GFLOP/s through MKL and 240 through oneDNN on a 128x1024x1024 product. A program
easyfit compiles is easyfit's own code, so each of its products goes to the faster library: every shape is timed
once per process on both, and oneDNN takes it when it is at least `WIN` times faster (where MKL is as fast, as on
Intel's CPUs, nothing changes). Both compute in float32; only the order of the sums differs (about 1e-6 relative).

The products are swapped after inductor's own graph passes (`post_grad_custom_post_pass`), for the op
`easyfit::onednn_mm`, which inductor calls like any other kernel it does not generate.
"""
from __future__ import annotations

import functools
import time

import torch

from easyfit.utils.torch_internals import CustomGraphPass, get_hash_for_files, unset_fake_temporarily

aten = torch.ops.aten
#: how much faster oneDNN must be on a shape to take it: a clear win, so that a close call does not flip between runs
WIN = 1.25
#: products smaller than this many multiply-adds stay with torch's `mm` untimed: a call costs more than the arithmetic
SMALLEST = 1 << 20
#: a product whose first call takes longer than this many seconds is timed once more, not 5 times
LONG = 0.05

_LIBRARY = torch.library.Library("easyfit", "FRAGMENT")
_LIBRARY.define("onednn_mm(Tensor a, Tensor b, Tensor? bias=None) -> Tensor")


def onednn_mm(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`a @ b` (+ `bias`, a row added to every row of the result) by oneDNN's matrix product."""
    return torch.ops.mkldnn._linear_pointwise(a, b.t(), bias, "none", [], "")


def _shape_only(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return a.new_empty((a.shape[0], b.shape[1]))


_LIBRARY.impl("onednn_mm", onednn_mm, "CPU")
_LIBRARY.impl("onednn_mm", _shape_only, "Meta")


def available() -> bool:
    """Whether this torch build has oneDNN's CPU kernels."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


@functools.cache
def onednn_is_faster(m: int, k: int, n: int, a_transposed: bool, b_transposed: bool, bias: bool) -> bool:
    """Whether oneDNN computes an (m x k) @ (k x n) product, laid out so, at least WIN times faster than `mm` here
    (each timed by `_best_time` in this process, on the threads torch uses)."""
    if m * k * n < SMALLEST:
        return False
    with unset_fake_temporarily(), torch.no_grad():   # the pass runs while inductor traces with fake tensors
        return _times_faster(m, k, n, a_transposed, b_transposed, bias) >= WIN


def _times_faster(m: int, k: int, n: int, a_transposed: bool, b_transposed: bool, bias: bool) -> float:
    own = torch.Generator().manual_seed(0)   # the fit's random numbers are not drawn from
    a = torch.randn(k, m, generator=own).t() if a_transposed else torch.randn(m, k, generator=own)
    b = torch.randn(n, k, generator=own).t() if b_transposed else torch.randn(k, n, generator=own)
    row = torch.randn(n, generator=own) if bias else None
    return _best_time(lambda: torch.addmm(row, a, b) if bias else torch.mm(a, b)) / \
        _best_time(lambda: onednn_mm(a, b, row))


def _best_time(call) -> float:
    """The best of 5 timed calls after a warm-up; of 1 when the warm-up took over LONG seconds (a large product, whose
    timing would otherwise add seconds to the compilation)."""
    started = time.perf_counter()
    call()
    times = []
    for _ in range(1 if time.perf_counter() - started > LONG else 5):
        started = time.perf_counter()
        call()
        times.append(time.perf_counter() - started)
    return min(times)


def _is_transposed(tensor) -> bool:
    return tensor.stride(0) == 1 and tensor.stride(1) != 1


class OneDnnMatmuls(CustomGraphPass):
    """Inductor's graph pass that swaps a CPU float32 `mm`, or an `addmm` adding a bias row, for `easyfit::onednn_mm`
    where oneDNN is faster on this machine; a product with a dynamic size (a dimension that changes between batches)
    keeps torch's `mm`, as there is no one shape to time."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        for node in list(graph.nodes):
            operands = _operands(node)
            if operands is None:
                continue
            a, b, bias = (value.meta["val"] if value is not None else None for value in operands)
            sizes = (a.shape[0], a.shape[1], b.shape[1])
            if not all(isinstance(size, int) for size in sizes):   # a dynamic size (changing batches) is not timed
                continue
            if onednn_is_faster(*sizes, _is_transposed(a), _is_transposed(b), bias is not None):
                with graph.inserting_before(node):
                    swapped = graph.call_function(torch.ops.easyfit.onednn_mm.default, operands)
                swapped.meta.update(node.meta)
                node.replace_all_uses_with(swapped)
                graph.erase_node(node)

    def uuid(self) -> bytes:
        """What inductor's cache of compiled graphs keys this pass by: this file's contents."""
        return get_hash_for_files((__file__,))


def _operands(node: torch.fx.Node) -> tuple | None:
    """(a, b, bias or None) of an `mm` or a plain `addmm` with a bias row on CPU float32 tensors; None otherwise."""
    if node.op != "call_function" or node.kwargs:
        return None
    if node.target is aten.mm.default:
        operands = (*node.args, None)
    elif node.target is aten.addmm.default and len(node.args) == 3:
        operands = (node.args[1], node.args[2], node.args[0])
        bias, b = (getattr(value, "meta", {}).get("val") for value in (operands[2], operands[1]))
        if getattr(bias, "shape", None) != getattr(b, "shape", (0, 0))[1:]:   # a row for every column only
            return None
    else:
        return None
    values = [value.meta.get("val") for value in operands if value is not None]
    if not all(isinstance(value, torch.Tensor) and value.device.type == "cpu" and value.dtype == torch.float32
               for value in values):
        return None
    return operands
