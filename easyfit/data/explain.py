"""What goes wrong on a first batch, in words: torch's errors on data the net cannot take, a tuple output given to
a loss or metrics that take one tensor, a loss that is not a scalar, a BatchNorm batch of one."""
from __future__ import annotations

import math
import re

import torch
from torch import nn
from torch.utils.data import DataLoader

from easyfit.data.batches import TensorBatches
from easyfit.data.contents import batch_length
from easyfit.parts.outputs import prediction

BATCH_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)


def float_dtype(net: nn.Module) -> torch.dtype:
    return next((p.dtype for p in net.parameters() if p.is_floating_point()), torch.get_default_dtype())


def describe(value) -> str:
    """A tensor, or a tuple / list / dict of them, in words."""
    if isinstance(value, torch.Tensor):
        return f"a {str(value.dtype).replace('torch.', '')} tensor of shape {tuple(value.shape)}"
    if isinstance(value, (tuple, list)):
        return "inputs " + ", ".join(describe(item) for item in value)
    if isinstance(value, dict):
        return "inputs " + ", ".join(f"{key}: {describe(item)}" for key, item in value.items())
    return type(value).__name__


def _layer(net: nn.Module, kinds, **attributes) -> str:
    """The name of the first layer of `kinds` with those attributes, as a phrase ('' when none matches)."""
    for name, module in net.named_modules():
        if isinstance(module, kinds) and all(getattr(module, key) == value for key, value in attributes.items()):
            return f"its layer {name or 'net'!r} ({type(module).__name__})"
    return "the net"


def explain(error: Exception, net: nn.Module, inputs, source: str) -> Exception:
    """torch's error on the first batch, in words, when it is one of the usual data mistakes; else the error."""
    text, data = str(error).split("\n")[0], describe(inputs)
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
                         f"{str(float_dtype(net)).replace('torch.', '')} ({text}). Convert the inputs where they "
                         "are made, e.g. x.float() in your Dataset (uint8 images: x.float() / 255), or pass arrays "
                         "or tensors, which easyfit converts itself.")
    return error


def _output_in_words(output) -> str:
    if isinstance(output, torch.Tensor):
        return f"a tensor of shape {tuple(output.shape)}"
    if isinstance(output, (tuple, list)):
        return f"a {type(output).__name__} of {len(output)} ({', '.join(_output_in_words(item) for item in output)})"
    if isinstance(output, dict):
        return f"a dict with keys {', '.join(map(repr, output))}"
    return f"a {type(output).__name__}"


def check_output_kind(output, loss_fn, metrics) -> None:
    """A net that returns a tuple (an LSTM's (out, (h, c)), auxiliary outputs) to a torch loss or to metrics, which
    take one tensor: say what came back and how to pick the output. A structured output's prediction (its `logits`:
    easyfit.parts.outputs) is one tensor."""
    if isinstance(prediction(output), torch.Tensor):
        return
    loss = getattr(loss_fn, "loss_fn", loss_fn)   # a sample-weighted loss wraps the user's
    takers = ([f"the loss {type(loss).__name__}"] if isinstance(loss, nn.modules.loss._Loss) else []) + \
             ([f"the metrics {', '.join(metrics.names)}"] if metrics else [])
    if not takers:
        return   # the user's own loss takes what the net returns
    first = "net(x)[0]" if isinstance(output, (tuple, list)) else "net(x)['logits']"
    raise TypeError(
        f"the net returned {_output_in_words(output)}, but {' and '.join(takers)} take one tensor. Pick the output "
        f"they should see with a small wrapper, e.g. class Head(nn.Module) whose forward returns {first} (for an "
        "LSTM: out, _ = self.lstm(x); return self.linear(out[:, -1])), or pass a loss that takes the whole output, "
        "e.g. loss=lambda output, target: F.cross_entropy(output[0], target) (then metrics need the wrapper too). "
        "A dict, named tuple or transformers ModelOutput gives its 'logits' entry, or its one tensor besides "
        "'loss'.")


def check_scalar_loss(loss) -> None:
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        got = f"shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise ValueError(f"the loss must return one number (a scalar tensor) to train on; it returned {got}. "
                         "Average it: reduction='mean' for a torch loss, or return loss.mean() from your function.")


def check_batch_of_one(batches, norms: list, source: str) -> None:
    """BatchNorm over (batch, features) cannot train on a batch of one sample: say so before the epoch that has one."""
    norm = next(((name, module) for name, module, shape in norms if math.prod(shape[2:]) == 1), None)
    sizes = _batch_sizes(batches) if norm is not None else None
    if sizes is None or 1 not in sizes[0]:
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
