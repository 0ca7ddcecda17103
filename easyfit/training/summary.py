"""A Keras-like table of a net's layers: module path, type, output shape and parameter count; for a net sharded by
tensor parallelism or FSDP (inside fit), each sharded parameter's piece on this rank as well."""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from easyfit.data.arrays import as_tensor
from easyfit.data.contents import call_net, move_to_device

HEADERS = ("Layer (module path)", "Type", "Output shape", "Param #")


def print_summary(net: nn.Module, print_fn: Any = print, input_example: Any = None) -> str:
    """Model.summary: the table, printed with `print_fn` unless it is None. An example given as the first argument
    (`summary(x)`, where `print_fn` stands) is taken as the example."""
    if print_fn is not None and not callable(print_fn):
        if input_example is not None:
            raise TypeError(f"summary's first argument is print_fn (a function that prints the text, or None), got "
                            f"{type(print_fn).__name__}; pass the example alone, summary(x), or as input_example=x")
        print_fn, input_example = print, print_fn
    text = summarize(net, input_example)
    if print_fn is not None:
        print_fn(text)
    return text


def summarize(net: nn.Module, input_example: Any = None) -> str:
    """The table as text. Rows are the leaf modules (and any module holding parameters of its own).

    Output shapes are shown when `input_example` is given (a tensor, a tuple of positional inputs, or a dict of
    keyword inputs): it is run through the net once, in eval mode without gradients; otherwise they show "?".
    """
    layers = [(name or "(net)", module) for name, module in net.named_modules()
              if next(module.children(), None) is None or next(module.parameters(recurse=False), None) is not None]
    shapes = _output_shapes(net, [module for _, module in layers], input_example) if input_example is not None else {}
    rows = [(name, type(module).__name__, shapes.get(id(module), "?"),
             _count(list(module.parameters(recurse=False)))) for name, module in layers]
    params = list(net.parameters())
    total = sum(p.numel() for p in params)
    trainable = sum(p.numel() for p in params if p.requires_grad)
    return "\n".join([f"Model: {type(net).__name__}", *_table(rows),
                      f"Total params: {_count(params)}", f"Trainable params: {trainable:,}",
                      f"Non-trainable params: {total - trainable:,}", *_sharded_rows(net)])


def described_net(net: nn.Module, training_net: nn.Module | None) -> nn.Module:
    """The net summary describes: inside a fit, the training copy when it holds sharded parameters, else the net."""
    if training_net is None:
        return net
    from easyfit.distributed.strategies.dtensor import holds_dtensors
    return training_net if holds_dtensors(training_net) else net


def _local(param: torch.Tensor) -> torch.Tensor | None:
    """This rank's piece of a sharded (DTensor) parameter; None for a whole one."""
    to_local = getattr(param, "to_local", None)
    return to_local() if callable(to_local) and hasattr(param, "placements") else None


def _count(params: list[torch.Tensor]) -> str:
    """The parameters' full count, and what this rank holds when some are sharded: "4,096 (2,048 on this rank)"."""
    total = sum(p.numel() for p in params)
    pieces = [_local(p) for p in params]
    if all(piece is None for piece in pieces):
        return f"{total:,}"
    here = sum((p if piece is None else piece).numel() for p, piece in zip(params, pieces))
    return f"{total:,} ({here:,} on this rank)"


def _sharded_rows(net: nn.Module) -> list[str]:
    """One line per sharded parameter: its shape on this rank, its full shape and how it is placed on the mesh."""
    lines = [f"  {name}: {tuple(_local(p).shape)} of {tuple(p.shape)}, {_placements(p)}"
             for name, p in net.named_parameters() if _local(p) is not None]
    return ["Sharded parameters (shape on this rank of the full shape; per mesh dimension):", *lines] \
        if lines else []


def _placements(param) -> str:
    """E.g. "tp: split on dim 0" or "dp: split on dim 0, tp: whole"."""
    names = param.device_mesh.mesh_dim_names or tuple(f"mesh dim {i}" for i in range(param.device_mesh.ndim))
    return ", ".join(f"{name}: {_placement(placement)}" for name, placement in zip(names, param.placements))


def _placement(placement) -> str:
    if placement.is_shard():
        return f"split on dim {placement.dim}"
    return "whole" if placement.is_replicate() else "partial sums"


def _table(rows: list[tuple[str, str, str, str]]) -> list[str]:
    widths = [max(len(row[column]) for row in (HEADERS, *rows)) for column in range(len(HEADERS))]

    def line(cells) -> str:
        *left, count = cells
        return "  ".join([*(cell.ljust(width) for cell, width in zip(left, widths)), count.rjust(widths[-1])])

    rule = "=" * len(line(HEADERS))
    return [rule, line(HEADERS), rule, *(line(row) for row in rows), rule]


def _output_shapes(net: nn.Module, modules: list[nn.Module], input_example: Any) -> dict[int, str]:
    """id(module) -> the shape of its output on its first call during one forward pass of `input_example`."""
    shapes: dict[int, str] = {}

    def record(module, args, output) -> None:
        shapes.setdefault(id(module), _describe(output))

    handles = [module.register_forward_hook(record) for module in modules]
    was_training = net.training
    device = next(net.parameters(), torch.empty(0)).device
    try:
        net.eval()
        with torch.no_grad():
            call_net(net, move_to_device(_as_tensors(input_example, net), device))
    finally:
        net.train(was_training)
        for handle in handles:
            handle.remove()
    return shapes


def _as_tensors(example: Any, net: nn.Module) -> Any:
    """numpy arrays (alone, in a tuple or list, or as dict values) as tensors, floats in the net's float dtype:
    summary takes what fit takes."""
    dtype = next((p.dtype for p in net.parameters() if p.is_floating_point()), torch.get_default_dtype())

    def convert(value: Any) -> Any:
        if isinstance(value, torch.Tensor) or not hasattr(value, "__array__"):
            return value
        tensor = as_tensor(value, "input_example", dtype)
        return tensor.to(dtype) if tensor.is_floating_point() else tensor

    if isinstance(example, (tuple, list)):
        return type(example)(convert(item) for item in example)
    if isinstance(example, dict):
        return {key: convert(value) for key, value in example.items()}
    return convert(example)


def _describe(output: Any) -> str:
    if isinstance(output, torch.Tensor):
        return str(tuple(output.shape))
    if isinstance(output, (tuple, list)):
        return f"[{', '.join(_describe(item) for item in output)}]"
    if isinstance(output, dict):
        return "{" + ", ".join(f"{key}: {_describe(value)}" for key, value in output.items()) + "}"
    return type(output).__name__
