"""`model.export`: the net as a file that serves without easyfit: ONNX (`*.onnx`, run by onnxruntime) or a
torch.export program (`*.pt2`, read by `torch.export.load`), traced once on an example input with the batch
dimension dynamic, in eval mode, on the CPU, in float32 unless asked otherwise, and written atomically.

The example is the caller's `input_example=` or the first batch the Model last saw (`recorded_example`: two of its
samples on the CPU, which is all a trace needs). torch.export and the ONNX exporter are imported on use."""
from __future__ import annotations

import contextlib
import copy
import importlib.util
import os

import numpy as np
import torch
from torch import nn
from torch.utils import _pytree

from easyfit.parts.item_counts import NUM_ITEMS
from easyfit.saving.checkpoint import write_atomically

#: the formats by name, and the suffix each takes when none is named
FORMATS = {".onnx": "onnx", ".pt2": "torch"}
#: the packages ONNX export needs (the extra easyfit[export])
ONNX_PACKAGES = ("onnx", "onnxscript")
#: batch keys that hold targets, never inputs of an exported net (easyfit.data.contents.TARGET_KEYS)
TARGET_KEYS = ("y", "target", "targets", "label", "labels")
#: keys a step adds to the user's inputs, never inputs of an exported net (a counted loss's item count)
STEP_KEYS = (NUM_ITEMS,)


class ExportError(RuntimeError):
    """torch.export could not trace the net."""


def recorded_example(inputs):
    """The example a later export traces with, from a batch's inputs as the net takes them (a tensor, a tuple of
    them, a dict of keyword inputs): `example_of` them, less the targets a dict passes into the forward and what
    the step added (`STEP_KEYS`): the user's inputs only."""
    if isinstance(inputs, dict):
        inputs = {key: value for key, value in inputs.items() if key not in TARGET_KEYS + STEP_KEYS}
    return example_of(inputs)


def example_of(inputs):
    """Inputs (tensors or numpy arrays, nested) cut to two samples, on the CPU: two, so that the batch dimension
    stays dynamic in the trace (a batch of one sample is repeated)."""
    def cut(value):
        if isinstance(value, np.ndarray):
            value = torch.from_numpy(value)
        if not isinstance(value, torch.Tensor) or value.dim() == 0:
            return value
        value = value.detach()[:2].cpu()
        return value.repeat(2, *[1] * (value.dim() - 1)) if len(value) == 1 else value.clone()
    return _pytree.tree_map(cut, inputs)


def export_format(path: str, format: str | None) -> str:
    """The format named, or the one `path`'s suffix says."""
    if format is None:
        suffix = os.path.splitext(path)[1].lower()
        if suffix not in FORMATS:
            raise ValueError(f"export({path!r}): cannot tell the format from the suffix {suffix!r}; name the file "
                             f"*.onnx or *.pt2, or pass format='onnx' or format='torch'")
        return FORMATS[suffix]
    if format not in FORMATS.values():
        raise ValueError(f"export: format must be 'onnx' or 'torch', got {format!r}")
    return format


def export_net(net: nn.Module, path: str | os.PathLike, format: str | None, example, dtype: torch.dtype) -> None:
    """Trace `net` on `example` (as the net is called: a tensor, a tuple of positional inputs or a dict of keyword
    ones) and write the program to `path` in `format` ("onnx", "torch"; None: from the suffix)."""
    path = os.fspath(path)
    format = export_format(path, format)
    if example is None:
        raise ValueError("export needs an example input to trace the net with: pass input_example= (a batch of "
                         "inputs, as the net takes them), or call fit, evaluate or predict first")
    if format == "onnx":
        missing = [name for name in ONNX_PACKAGES if importlib.util.find_spec(name) is None]
        if missing:
            raise ImportError(f"export to ONNX needs {', '.join(missing)}: pip install easyfit[export]")
    args, kwargs = _call_arguments(_converted(example, dtype))
    program = traced(_plain_copy(net, dtype), args, kwargs)
    if format == "torch":
        write_atomically(path, lambda temp_path: torch.export.save(program, temp_path))
    else:
        with _refused(net, "torch.onnx's exporter cannot convert"):
            onnx_program = torch.onnx.export(program, dynamo=True, external_data=False, verbose=False)
        write_atomically(path, lambda temp_path: onnx_program.save(temp_path, external_data=False))


def traced(net: nn.Module, args: tuple, kwargs: dict):
    """torch.export's program of `net` called as `net(*args, **kwargs)`, every input's first dimension one dynamic
    batch dimension; a net it cannot trace raises ExportError with torch's reason."""
    batch = torch.export.Dim("batch")
    # a spec per input, by position or by name, as the net is called (call_net passes one or the other)
    dims = _pytree.tree_map(lambda t: {0: batch} if isinstance(t, torch.Tensor) and t.dim() else None,
                            kwargs or args)
    with _refused(net, "torch.export cannot trace"):
        return torch.export.export(net, args, kwargs, dynamic_shapes=dims)


@contextlib.contextmanager
def _refused(net: nn.Module, what: str):
    """An error inside the block as an ExportError naming the net and torch's reason (the first paragraph of the
    error at the root of the chain)."""
    try:
        yield
    except Exception as error:
        cause = error
        while cause.__cause__ is not None:   # the exporter's own error wraps the one that says why
            cause = cause.__cause__
        reason = str(cause).strip().split("\n\n")[0]
        raise ExportError(f"{what} {type(net).__name__} (module {type(net).__module__}), so nothing was "
                          f"written. torch's reason: {type(cause).__name__}: {reason}") from error


def _call_arguments(example) -> tuple[tuple, dict]:
    """(args, kwargs) of the call `easyfit.training.loop.call_net` makes with `example`."""
    if isinstance(example, tuple):
        return example, {}
    if isinstance(example, dict):
        return (), example
    return (example,), {}


def _converted(example, dtype: torch.dtype):
    """The example on the CPU, its floating tensors in `dtype`."""
    return _pytree.tree_map(lambda t: t.to("cpu", dtype if t.is_floating_point() else t.dtype)
                            if isinstance(t, torch.Tensor) else t, example)


def _plain_copy(net: nn.Module, dtype: torch.dtype) -> nn.Module:
    """A copy of `net` on the CPU, its floating parameters and buffers in `dtype`, in eval mode: the caller's net
    keeps its device, dtype and mode. A transformers model's copy keeps no cache of past keys and values (its
    output would hold one, which a trace cannot return, and a program called on whole inputs never reads)."""
    net = copy.deepcopy(net).to("cpu").to(dtype).eval()
    config = getattr(net, "config", None)
    if getattr(config, "use_cache", False) is True:
        config.use_cache = False
    return net
