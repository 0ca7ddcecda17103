"""A SplitPlan carried out on the training copy of a net: each split as torch's ParallelStyle, tied weights tied
again."""
from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from easyfit.distributed.strategy_parts.tp_attention import HeadParallel
from easyfit.distributed.strategy_parts.tp_plan import Split, SplitPlan, retie, tied_groups


def output_layer(plan: SplitPlan) -> Split:
    """The split whose output is the net's logits under loss_parallel: the plan's last, a gathered column-wise
    Linear (its output is then left split over the classes)."""
    last = plan.splits[-1] if plan.splits else None
    if last is None or last.style != "colwise" or not last.gather:
        found = f"its last split is {last.path!r} ({last.words()})" if last else "it splits nothing"
        raise ValueError("loss_parallel=True computes the loss on logits split over the classes, so the plan must "
                         f"split the net's output layer column-wise with its output gathered; {found}. Give the "
                         "output Linear a size that divides by the tensor-parallel size, or use loss_parallel=False")
    return last


def torch_style(split: Split, module: nn.Module, logits: bool = False, sequence: bool = False) -> ParallelStyle:
    """torch's ParallelStyle for a split (`logits`: the output layer under loss_parallel; `sequence`: the activations
    between the splits are split along the sequence, dim 1: a row-wise layer's output is reduce-scattered there, a
    column-wise layer's input gathered from there)."""
    if split.custom is not None:
        return split.custom
    if split.style == "heads":
        return HeadParallel(sequence)
    if split.style == "sequence":
        return SequenceParallel(use_local_output=True)
    between = Shard(1) if sequence else Replicate()
    if split.style == "rowwise":
        if isinstance(module, nn.Embedding):
            return RowwiseParallel(input_layouts=Replicate(), output_layouts=between)
        return RowwiseParallel(output_layouts=between)
    if isinstance(module, nn.Embedding):
        return ColwiseParallel(input_layouts=Replicate(), output_layouts=between)
    if logits:
        return ColwiseParallel(input_layouts=between, output_layouts=Shard(-1), use_local_output=False)
    return ColwiseParallel(input_layouts=between, output_layouts=Replicate() if split.gather else Shard(-1))


def apply_plan(net: nn.Module, mesh: DeviceMesh, plan: SplitPlan, loss_parallel: bool = False,
               sequence_parallel: bool = False) -> None:
    """Split `net`'s modules over the 1-D TP `mesh` as `plan` says, in place."""
    modules = dict(net.named_modules())
    logits = output_layer(plan).path if loss_parallel else None
    ties = tied_groups(net)
    parallelize_module(net, mesh, {split.path: torch_style(split, modules[split.path], split.path == logits,
                                                           sequence_parallel)
                                   for split in plan.splits})
    retie(ties)
