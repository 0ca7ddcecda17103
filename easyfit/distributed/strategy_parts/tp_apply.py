"""A Plan carried out on the training copy of a net: each split as torch's ParallelStyle, tied weights tied again."""
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
from easyfit.distributed.strategy_parts.tp_plan import Plan, Split, retie, tied_groups


def output_layer(plan: Plan) -> Split:
    """The split whose output is the net's logits under loss_parallel: the plan's last, a gathered column-wise
    Linear (its output is then left split over the classes)."""
    last = plan.splits[-1] if plan.splits else None
    if last is None or last.style != "colwise" or not last.gather:
        found = f"its last split is {last.path!r} ({last.words()})" if last else "it splits nothing"
        raise ValueError("loss_parallel=True computes the loss on logits split over the classes, so the plan must "
                         f"split the net's output layer column-wise with its output gathered; {found}. Give the "
                         "output Linear a size that divides by the tensor-parallel size, or use loss_parallel=False")
    return last


def torch_style(split: Split, module: nn.Module, logits: bool = False) -> ParallelStyle:
    """torch's ParallelStyle for a split (`logits`: the output layer under loss_parallel)."""
    if split.custom is not None:
        return split.custom
    if split.style == "heads":
        return HeadParallel()
    if split.style == "sequence":
        return SequenceParallel()
    if split.style == "rowwise":
        return RowwiseParallel(input_layouts=Replicate()) if isinstance(module, nn.Embedding) else RowwiseParallel()
    if logits:
        return ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)
    return ColwiseParallel(output_layouts=Replicate()) if split.gather else ColwiseParallel()


def apply_plan(net: nn.Module, mesh: DeviceMesh, plan: Plan, loss_parallel: bool = False) -> None:
    """Split `net`'s modules over the 1-D TP `mesh` as `plan` says, in place."""
    modules = dict(net.named_modules())
    logits = output_layer(plan).path if loss_parallel else None
    ties = tied_groups(net)
    parallelize_module(net, mesh, {split.path: torch_style(split, modules[split.path], split.path == logits)
                                   for split in plan.splits})
    retie(ties)
