"""Random masks in a compiled program drawn by one eager call each, as in an eager step.

easyfit compiles with inductor's `fallback_random`, so that Dropout draws eager's numbers. Inside the whole-step
program (a step traced through `torch.func.grad_and_value`), a Dropout becomes `bernoulli.p` on a constant tensor,
which inductor lowers as a buffer filled with the constant and then overwritten in place by the random draw. With
several steps in one program (BatchNorm and Dropout in an MLP, 8 steps), inductor fused the kernel that fills the
buffer with the kernel that applies the mask, before the draw: the forward used the constant, the backward the
mask, and the net did not learn. Each `bernoulli.p` is swapped here for `easyfit::bernoulli_p`, one call that
returns a new tensor (nothing written in place to order wrongly), drawing the same numbers from the same generator.
"""
from __future__ import annotations

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

_LIBRARY = torch.library.Library("easyfit", "FRAGMENT")
_LIBRARY.define("bernoulli_p(Tensor x, float p) -> Tensor", tags=(torch.Tag.nondeterministic_seeded,))
_LIBRARY.impl("bernoulli_p", lambda x, p: torch.bernoulli(x, p), "CompositeExplicitAutograd")


class EagerMasks(CustomGraphPass):
    """Inductor's graph pass (`post_grad_custom_pre_pass`) that swaps each `aten.bernoulli.p` for
    `easyfit::bernoulli_p`."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        for node in graph.find_nodes(op="call_function", target=torch.ops.aten.bernoulli.p):
            if node.kwargs.get("generator") is not None or len(node.args) != 2:
                continue
            with graph.inserting_before(node):
                swapped = graph.call_function(torch.ops.easyfit.bernoulli_p.default, node.args)
            swapped.meta.update(node.meta)
            node.replace_all_uses_with(swapped)
            graph.erase_node(node)

    def uuid(self) -> bytes:
        """What inductor's cache of compiled graphs keys this pass by: this file's contents."""
        return get_hash_for_files((__file__,))
