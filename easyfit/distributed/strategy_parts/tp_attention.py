"""An nn.MultiheadAttention's heads split across the tensor-parallel ranks (torch has no ParallelStyle for it).

The fused input projection (rows: all query heads, all key heads, all value heads) becomes a DTensor whose local
rows are this rank's heads of each (`_StridedShard(0, split_factor=3)`), so its full tensor and state dict are the
plain layer's. The output projection is split row-wise: each rank's heads give a partial sum, all-reduced. The layer's
forward is replaced by one that computes this rank's heads with the same arguments and results as torch's.
"""
from __future__ import annotations

import types

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle
from torch.distributed.tensor.placement_types import _StridedShard

from easyfit.distributed.strategy_parts.tp_plan import attention_layers


def _local(tensor):
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def entering(tensor: torch.Tensor, mesh: DeviceMesh, sequence: bool = False) -> torch.Tensor:
    """`tensor` whole (`sequence`: this rank's part of the sequence, dim 1, gathered); in backward, this rank's
    partial gradient summed over the TP ranks (and split along the sequence again)."""
    entered = DTensor.from_local(tensor, mesh, [Shard(1) if sequence else Replicate()], run_check=False)
    return entered.redistribute(mesh, [Replicate()]).to_local(grad_placements=[Partial()])


def leaving(partial: torch.Tensor, mesh: DeviceMesh, sequence: bool = False) -> torch.Tensor:
    """This rank's partial sum, summed over the TP ranks (`sequence`: only this rank's part of the sequence kept)."""
    summed = DTensor.from_local(partial, mesh, [Partial()], run_check=False)
    return summed.redistribute(mesh, [Shard(1) if sequence else Replicate()]).to_local()


def additive(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """A boolean mask (True: masked out) as an additive one; a float mask as it is."""
    if mask is None or mask.dtype != torch.bool:
        return mask if mask is None else mask.to(dtype)
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(mask, float("-inf"))


def head_split_forward(self, query, key, value, key_padding_mask=None, need_weights=True, attn_mask=None,
                       average_attn_weights=True, is_causal=False):
    """nn.MultiheadAttention.forward over this rank's heads."""
    mesh, size = self.tp_mesh, self.tp_mesh.size()
    if need_weights and not average_attn_weights:
        raise ValueError("an attention layer whose heads are split across ranks returns its weights averaged over "
                         "the heads only: call it with average_attn_weights=True or need_weights=False")
    if not self.batch_first:
        query, key, value = (x.transpose(0, 1) for x in (query, key, value))
    entered = {}
    query, key, value = (entered.setdefault(id(x), entering(x, mesh, self.tp_sequence)) for x in (query, key, value))
    heads, rank = self.num_heads // size, mesh.get_local_rank()
    weights = _local(self.in_proj_weight).chunk(3)
    biases = _local(self.in_proj_bias).chunk(3) if self.in_proj_bias is not None else (None,) * 3
    q, k, v = (F.linear(x, w, b).unflatten(-1, (heads, self.head_dim)).transpose(1, 2)
               for x, w, b in zip((query, key, value), weights, biases))
    batch, length, source = q.shape[0], q.shape[2], k.shape[2]
    mask = additive(attn_mask, q.dtype)
    if mask is not None and mask.dim() == 3:   # (batch * heads, L, S): this rank's heads
        mask = mask.view(batch, self.num_heads, length, source)[:, rank * heads:(rank + 1) * heads]
    padding = additive(key_padding_mask, q.dtype)
    if padding is not None:
        padding = padding.view(batch, 1, 1, source)
        mask = padding if mask is None else mask + padding
    dropout = self.dropout if self.training else 0.0
    causal = is_causal and mask is None
    if need_weights:
        scores = q @ k.transpose(-2, -1) * self.head_dim ** -0.5
        if causal:
            mask = torch.ones(length, source, dtype=torch.bool, device=q.device).triu(1)
            mask = additive(mask, q.dtype)
        attention = torch.softmax(scores if mask is None else scores + mask, dim=-1)
        out = F.dropout(attention, dropout) @ v
    else:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=causal)
    out = leaving(F.linear(out.transpose(1, 2).flatten(2), _local(self.out_proj.weight)), mesh, self.tp_sequence)
    if self.out_proj.bias is not None:
        out = out + _local(self.out_proj.bias)
    if not self.batch_first:
        out = out.transpose(0, 1)
    if not need_weights:
        return out, None
    return out, leaving(attention.sum(dim=1) / self.num_heads, mesh)


def split_heads(attention: nn.MultiheadAttention, mesh: DeviceMesh, sequence: bool = False) -> None:
    """Shard the layer's projections by heads over `mesh` and give it the forward over this rank's heads
    (`sequence`: its inputs and output are this rank's part of the sequence)."""
    def shard(param: torch.Tensor | None, placement) -> nn.Parameter | None:
        return None if param is None else nn.Parameter(distribute_tensor(param.data, mesh, [placement]),
                                                       requires_grad=param.requires_grad)
    by_heads = _StridedShard(0, split_factor=3)
    attention.in_proj_weight = shard(attention.in_proj_weight, by_heads)
    if attention.in_proj_bias is not None:
        attention.in_proj_bias = shard(attention.in_proj_bias, by_heads)
    attention.out_proj.weight = shard(attention.out_proj.weight, Shard(1))
    if attention.out_proj.bias is not None:
        attention.out_proj.bias = shard(attention.out_proj.bias, Replicate())
    attention.tp_mesh, attention.tp_sequence = mesh, sequence
    attention.forward = types.MethodType(head_split_forward, attention)


class HeadParallel(ParallelStyle):
    """The ParallelStyle of a "heads" split: an attention layer, or a transformer layer's attention layers
    (`sequence`: under sequence parallelism)."""

    def __init__(self, sequence: bool = False):
        super().__init__()
        self.sequence = sequence

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        for _, attention in attention_layers(module):
            split_heads(attention, device_mesh, self.sequence)
        return module
