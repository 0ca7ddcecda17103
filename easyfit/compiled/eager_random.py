"""Random masks in a compiled program drawn by one eager call each, as in an eager step.

easyfit compiles with inductor's `fallback_random`, so that Dropout draws eager's numbers. Inside the whole-step
program (a step traced through `torch.func.grad_and_value`), a Dropout becomes `bernoulli.p` on a constant tensor,
which inductor lowers as a buffer filled with the constant and then overwritten in place by the random draw. With
several steps in one program (BatchNorm and Dropout in an MLP, 8 steps), inductor fused the kernel that fills the
buffer with the kernel that applies the mask, before the draw: the forward used the constant, the backward the
mask, and the net did not learn. Each `bernoulli.p` is swapped here for `easyfit::bernoulli_p`, one call that
returns a new tensor (nothing written in place to order wrongly), drawing the same numbers from the same generator.

Under `torch.func.grad_and_value` a Dropout draws its mask over a new contiguous tensor, where eager torch draws it
over a tensor laid out as the Dropout's input (`empty_like(input).bernoulli_(1 - p)`). On a CPU the two layouts take
different kernels when the input is not contiguous (the attention output a TransformerEncoderLayer's `dropout1`
takes), so the masks differed from eager's. Before the whole-step program is traced, each training Dropout of a CPU
tensor becomes `input * easyfit::dropout_noise(...)`: the noise eager torch makes, in the layout it makes it.
"""
from __future__ import annotations

import inspect
import operator

import torch
import torch.nn.functional as F

from easyfit.utils.torch_internals import CustomGraphPass, get_hash_for_files

_LIBRARY = torch.library.Library("easyfit", "FRAGMENT")
_LIBRARY.define("bernoulli_p(Tensor x, float p) -> Tensor", tags=(torch.Tag.nondeterministic_seeded,))
_LIBRARY.impl("bernoulli_p", lambda x, p: torch.bernoulli(x, p), "CompositeExplicitAutograd")
_LIBRARY.define("dropout_noise(SymInt[] size, SymInt[] stride, float p, ScalarType dtype, Device device) -> Tensor",
                tags=(torch.Tag.nondeterministic_seeded,))


def _dropout_noise(size, stride, p, dtype, device):
    """Eager Dropout's noise: kept with probability 1 - p, scaled by 1 / (1 - p), in the given layout."""
    return torch.empty_strided(size, stride, dtype=dtype, device=device).bernoulli_(1 - p).div_(1 - p)


_LIBRARY.impl("dropout_noise", _dropout_noise, "CompositeExplicitAutograd")
torch.library.register_fake("easyfit::dropout_noise")(
    lambda size, stride, p, dtype, device: torch.empty_strided(size, stride, dtype=dtype, device=device))
_DROPOUT = inspect.signature(F.dropout)


def eager_dropout_masks(graph_module: torch.fx.GraphModule) -> None:
    """Each training `F.dropout` of a CPU tensor in a traced graph becomes `input * easyfit::dropout_noise(...)`,
    the noise laid out as eager torch lays it out (`empty_like(input)`). A dropout in place, on another device or
    with a training flag or rate that is not a constant stays as it is."""
    graph = graph_module.graph
    for node in graph.find_nodes(op="call_function", target=F.dropout):
        arguments = _DROPOUT.bind(*node.args, **node.kwargs)
        arguments.apply_defaults()
        source, p = arguments.arguments["input"], arguments.arguments["p"]
        value = source.meta.get("example_value") if isinstance(source, torch.fx.Node) else None
        if (arguments.arguments["training"] is not True or arguments.arguments["inplace"] is not False
                or not isinstance(p, float) or not 0 < p < 1 or not isinstance(value, torch.Tensor)
                or value.device.type != "cpu"):
            continue
        layout = torch.empty_like(torch.empty_strided(value.shape, value.stride(), device="meta")).stride()
        with graph.inserting_before(node):
            noise = graph.call_function(torch.ops.easyfit.dropout_noise.default,
                                        (list(value.shape), list(layout), p, value.dtype, value.device))
            masked = graph.call_function(operator.mul, (source, noise))
        masked.meta.update(node.meta)
        node.replace_all_uses_with(masked)
        graph.erase_node(node)
    graph_module.recompile()


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
