"""Before any training work, the first batch of each data source runs once through the net (in eval mode, without
gradients, on a copy of the RNG state): data the net cannot take, targets that do not suit the loss, a loss that is
not a scalar and a BatchNorm batch of one are then reported in words, not from deep inside torch.

In-memory data (arrays, tensors, DataFrames) is also brought once to what the net takes, as Keras does:
- floating inputs and targets become the net's float dtype (float16 or float64 data for a float32 net; float64 under
  precision="64");
- integer and bool inputs (uint8 images, 0/1 flags, counts) stay as they are when the net runs on them (an
  nn.Embedding takes integer indices); when it does not but runs on them as floats, they become floats. uint8
  images are not rescaled: divide them by 255 yourself;
- integer class labels of shape (N, 1) for a class-index loss (cross_entropy, nll) become shape (N,).
Batches from a Dataset, a DataLoader or an iterable are the user's own: a mismatch there is explained, not converted.
"""
from __future__ import annotations

import math
import re

import torch
from torch import nn
from torch.utils.data import DataLoader

from easyfit.data import PredictInputs, TensorBatches, batch_length, move_to_device, peek_first_batch, split_batch
from easyfit.loop import _eval_mode, call_net
from easyfit.losses import CLASS_INDEX_LOSSES, check_class_range, check_targets

BATCH_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)


def check_fit_data(model, net: nn.Module, train, val) -> None:
    """The training and validation data's first batches, before the first epoch."""
    check_first_batch(model, net, train, "the training data", training=True)
    if val is not None:
        check_first_batch(model, net, val, "the validation data")


def check_first_batch(model, net: nn.Module, batches, source: str, training: bool = False,
                      targets: bool = True) -> None:
    """Conform in-memory data to the net, run its first batch, and explain what would fail in the loop."""
    net, precision = model.strategy.module_for_eval(net), model.precision
    if isinstance(batches, TensorBatches):
        _conform_floats(batches, _data_dtype(net, precision))
    device = model.strategy.root_device
    batch = _peek(batches, device)
    if batch is None:
        return
    norms: list[tuple[str, nn.Module, torch.Size]] = []
    output = _run(net, precision, batches, batch, source, norms, _inputs_rule(net, targets), device)
    target = split_batch(batch)[1]
    if training:
        _check_batch_of_one(batches, norms, source)
    if targets and target is not None and isinstance(output, torch.Tensor) and isinstance(target, torch.Tensor):
        _check_loss(model.loss_fn, batches, precision, output, target)


def _inputs_rule(net: nn.Module, targets: bool):
    """How the loop takes a batch's inputs: as in training, or by predict's rule (whose warning the loop gives)."""
    if targets:
        return lambda batch: split_batch(batch)[0]
    rule = PredictInputs(net)
    rule.warned = True
    return rule


# --- conforming in-memory data --------------------------------------------------------------
def _float_dtype(net: nn.Module) -> torch.dtype:
    return next((p.dtype for p in net.parameters() if p.is_floating_point()), torch.get_default_dtype())


def _data_dtype(net: nn.Module, precision) -> torch.dtype:
    """The dtype in-memory float data is conformed to: the net's, unless the backend casts the inputs itself."""
    return torch.float32 if precision.casts_inputs else _float_dtype(net)


def _conform_floats(batches: TensorBatches, dtype: torch.dtype) -> None:
    batches.tensors = tuple(t.to(dtype) if t.is_floating_point() else t for t in batches.tensors)


def _input_count(batches: TensorBatches) -> int:
    """How many of the tensors are the net's inputs (the last one is the target when there are several)."""
    return len(batches.tensors) if batches.inputs_only else max(1, len(batches.tensors) - 1)


def _integers_to_floats(batches: TensorBatches, dtype: torch.dtype) -> bool:
    """Turn integer and bool inputs into `dtype`; False when there were none."""
    count, tensors = _input_count(batches), batches.tensors
    if all(t.is_floating_point() or t.is_complex() for t in tensors[:count]):
        return False
    batches.tensors = tuple(t.to(dtype) if i < count and not t.is_floating_point() else t
                            for i, t in enumerate(tensors))
    return True


def _peek(batches, device: torch.device):
    """The first batch (see `peek_first_batch`), on the net's device (where the backend's loader would put it)."""
    batch = peek_first_batch(batches)
    return None if batch is None else move_to_device(batch, device)


def _run(net: nn.Module, precision, batches, batch, source: str, norms: list, to_inputs, device: torch.device):
    """The net's output on `batch`; in-memory integer inputs become floats when only floats run."""
    try:
        return _forward(net, precision, to_inputs(precision.convert_input(batch)), norms)
    except (RuntimeError, TypeError) as error:
        if not (isinstance(batches, TensorBatches) and _integers_to_floats(batches, _data_dtype(net, precision))):
            raise _explain(error, net, to_inputs(batch), source) from error
    batch = _peek(batches, device)
    try:
        return _forward(net, precision, to_inputs(precision.convert_input(batch)), norms)
    except (RuntimeError, TypeError) as error:
        raise _explain(error, net, to_inputs(batch), source) from error


def _forward(net: nn.Module, precision, inputs, norms: list):
    """One forward pass that changes nothing: no gradients, eval mode, the RNG state restored after it."""
    norms.clear()
    hooks = [module.register_forward_pre_hook(lambda m, args, name=name: norms.append((name, m, args[0].shape)))
             for name, module in net.named_modules() if isinstance(module, BATCH_NORMS)]
    cuda = sorted({p.device.index or 0 for p in net.parameters() if p.device.type == "cuda"})
    try:
        with torch.random.fork_rng(devices=cuda), torch.no_grad(), _eval_mode(net), precision.autocast():
            return call_net(net, inputs)
    finally:
        for hook in hooks:
            hook.remove()


def _describe(inputs) -> str:
    if isinstance(inputs, torch.Tensor):
        return f"a {str(inputs.dtype).replace('torch.', '')} tensor of shape {tuple(inputs.shape)}"
    if isinstance(inputs, (tuple, list)):
        return "inputs " + ", ".join(_describe(item) for item in inputs)
    if isinstance(inputs, dict):
        return "inputs " + ", ".join(f"{key}: {_describe(value)}" for key, value in inputs.items())
    return type(inputs).__name__


def _layer(net: nn.Module, kinds, **attributes) -> str:
    """The name of the first layer of `kinds` with those attributes, as a phrase ('' when none matches)."""
    for name, module in net.named_modules():
        if isinstance(module, kinds) and all(getattr(module, key) == value for key, value in attributes.items()):
            return f"its layer {name or 'net'!r} ({type(module).__name__})"
    return "the net"


def _explain(error: Exception, net: nn.Module, inputs, source: str) -> Exception:
    """torch's error on the first batch, in words, when it is one of the usual data mistakes; else the error."""
    text, data = str(error).split("\n")[0], _describe(inputs)
    widths = re.search(r"shapes cannot be multiplied \((\d+)x(\d+) and (\d+)x(\d+)\)", text)
    if widths:
        got, expected = int(widths[2]), int(widths[3])
        flatten = (" nn.Linear acts on the last dimension: flatten images first (nn.Flatten())."
                   if isinstance(inputs, torch.Tensor) and inputs.dim() > 2 else "")
        return ValueError(f"{source} does not fit the net: {_layer(net, nn.Linear, in_features=expected)} expects "
                          f"{expected} features per sample, but the data has {got} ({data}). Pass data with "
                          f"{expected} features, or build the layer as nn.Linear({got}, ...).{flatten}")
    channels = re.search(r"to have (\d+) channels, but got (\d+) channels", text)
    if channels:
        expected, got = int(channels[1]), int(channels[2])
        layout = (" The data looks channels-last: use x.permute(0, 3, 1, 2)."
                  if isinstance(inputs, torch.Tensor) and inputs.shape[-1] == expected else "")
        return ValueError(f"{source} does not fit the net: {_layer(net, nn.modules.conv._ConvNd, in_channels=expected)}"
                          f" expects {expected} channels, but the data has {got} ({data}); images are (batch, "
                          f"channels, height, width).{layout}")
    if re.search(r"dtype|scalar type|Input type|should be the same|but found", text):
        return TypeError(f"the net cannot run on {source} ({data}): its parameters are "
                         f"{str(_float_dtype(net)).replace('torch.', '')} ({text}). Convert the inputs where they "
                         "are made, e.g. x.float() in your Dataset (uint8 images: x.float() / 255), or pass arrays "
                         "or tensors, which easyfit converts itself.")
    return error


# --- what the loop would meet ---------------------------------------------------------------
def _check_loss(loss_fn, batches, precision, output: torch.Tensor, target: torch.Tensor) -> None:
    if isinstance(batches, TensorBatches) and isinstance(loss_fn, CLASS_INDEX_LOSSES) \
            and not target.is_floating_point() and output.dim() == 2 and target.shape[1:] == (1,):
        batches.tensors = (*batches.tensors[:-1], batches.tensors[-1].view(-1))   # (N, 1) labels: as Keras
        target = target.view(-1)
    check_targets(loss_fn, output, target)
    if isinstance(batches, TensorBatches) and isinstance(loss_fn, CLASS_INDEX_LOSSES) \
            and not target.is_floating_point() and output.dim() >= 2:
        check_class_range(loss_fn, output.shape[1], batches.tensors[-1])   # every label, not only the first
    with torch.no_grad(), precision.autocast():
        loss = loss_fn(output, target)
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        got = f"shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise ValueError(f"the loss must return one number (a scalar tensor) to train on; it returned {got}. "
                         "Average it: reduction='mean' for a torch loss, or return loss.mean() from your function.")


def _check_batch_of_one(batches, norms: list, source: str) -> None:
    """BatchNorm over (batch, features) cannot train on a batch of one sample: say so before the epoch that has one."""
    norm = next(((name, module) for name, module, shape in norms if math.prod(shape[2:]) == 1), None)
    sizes = _batch_sizes(batches)
    if norm is None or sizes is None or 1 not in sizes[0]:
        return
    (name, module), (_, samples, batch_size) = norm, sizes
    better = next((b for step in range(1, batch_size + 2) for b in (batch_size + step, batch_size - step)
                   if b > 1 and samples % b != 1), None)
    if better is None:
        fix = "Train on at least 2 samples"
    elif batch_size == 1:
        fix = "Use batch_size=2 or more"
    else:
        fix = (f"Use a batch_size that leaves a larger last batch (e.g. {better}), or drop the short last batch: "
               f"pass DataLoader(dataset, batch_size={batch_size}, shuffle=True, drop_last=True)")
    raise ValueError(f"{source} has a batch of 1 sample ({samples} samples in batches of {batch_size}), and "
                     f"{type(module).__name__} {name!r} cannot normalise a single sample in training. {fix}.")


def _batch_sizes(batches) -> tuple[set[int], int, int] | None:
    """(the batch sizes of an epoch, samples, batch_size) when they are known before the epoch, else None."""
    loader = getattr(batches, "loader", None)
    if isinstance(loader, (list, tuple)):
        lengths = [batch_length(batch) for batch in loader]
        return set(lengths), sum(lengths), max(lengths, default=0)
    if isinstance(batches, TensorBatches):
        samples, size, drop_last = len(batches.sampler), batches.batch_size, False
    elif isinstance(loader, DataLoader) and loader.batch_size is not None and hasattr(loader.sampler, "__len__"):
        samples, size, drop_last = len(loader.sampler), loader.batch_size, loader.drop_last
    else:
        return None
    last = samples % size
    return {size} | ({last} if last and not drop_last else set()), samples, size
