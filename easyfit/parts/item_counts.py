"""Losses that average over counted items (tokens): how many items a batch holds, and the sum of their losses.

A causal LM's loss, a masked LM's, a token classifier's or a cross entropy over `(batch, time)` targets is the mean
over the items whose target is not the ignore index (-100: padding). The mean of a step made of several
micro-batches or ranks is the sum of every item's loss divided by the number of items of the step
(easyfit.training.item_windows). `item_counting(loss_fn, net)` says how, for the losses easyfit knows:

- loss="model" on a transformers causal LM (the labels shifted by one), masked LM or token classifier;
- a class-index loss (`cross_entropy` / `nll` by name, `nn.CrossEntropyLoss` / `nn.NLLLoss`, or a
  `functools.partial` of `F.cross_entropy` / `F.nll_loss`) with the mean reduction and no class weights, over
  targets of two or more dimensions;
- a loss of the user's with a method `item_count(target)`: the number of items its mean is over.

Any other loss stays a per-batch mean (batches weighted by their samples)."""
from __future__ import annotations

import functools
import inspect
from typing import Any, Callable

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from easyfit.parts.losses import CLASS_INDEX_LOSSES
from easyfit.parts.outputs import ModelLoss, prediction

#: the target value these losses leave out (transformers' models and torch's losses by default)
IGNORE_INDEX = -100
#: transformers model families whose own loss is the mean over labels other than -100; True: shifted by one
MODEL_FAMILIES = {"ForCausalLM": True, "ForMaskedLM": False, "ForTokenClassification": False}
#: the libraries whose wrappers hold the user's net as `module`
WRAPPER_LIBRARIES = ("torch.", "deepspeed.", "fairscale.", "bagua.")
#: what a transformers model's forward passes to its `loss_function` to divide the summed loss by
NUM_ITEMS = "num_items_in_batch"


class ItemCounting:
    """How a loss that is the mean over a batch's counted items is counted and summed. The step trains on
    `sum of the items' losses / denominator`; evaluation's denominator is 1. Here: the loss's mean times the
    batch's items, which the step puts in the tensor `items` before it runs (an input of a compiled step)."""

    #: the divided loss reads the batch's items from `items` (else it sums by itself)
    uses_batch_items = True

    def applies(self, target: Any) -> bool:
        """Whether the batches with targets like `target` are counted (else each is a per-batch mean)."""
        return True

    def count(self, target: torch.Tensor) -> torch.Tensor | int:
        """The number of counted items of a batch's targets (see `count_items`)."""
        return count_items(target, IGNORE_INDEX)

    def inputs(self, inputs: Any, denominator: torch.Tensor) -> Any:
        """The net's inputs for a step divided by `denominator` (the net's own loss divides itself)."""
        return inputs

    def divided_loss(self, loss_fn: Callable, denominator: torch.Tensor, items: torch.Tensor) -> Callable:
        """loss(output, target) -> the batch's item losses summed, over `denominator`."""
        return functools.partial(self.divided, loss_fn, denominator, items)

    def divided(self, loss_fn: Callable, denominator: torch.Tensor, items: torch.Tensor, output, target,
                loss=None) -> torch.Tensor:
        """The batch's summed item losses over `denominator`; `loss`: the mean `loss_fn` already computed."""
        mean = loss_fn(output, target) if loss is None else loss
        # a batch without items sums to 0 (its mean, 0 / 0, is NaN; torch.where passes no gradient to it)
        return torch.where(items > 0, mean * items, torch.zeros_like(mean)) / denominator


class ClassIndexItems(ItemCounting):
    """A cross entropy or NLL loss with an ignore index: summed by torch itself (a batch of padding only sums to 0)."""

    uses_batch_items = False

    def __init__(self, function: Callable, ignore_index: int, label_smoothing: float = 0.0):
        self.function, self.ignore_index, self.label_smoothing = function, ignore_index, label_smoothing

    def applies(self, target: Any) -> bool:
        return isinstance(target, torch.Tensor) and not target.is_floating_point() and target.dim() >= 2

    def count(self, target: torch.Tensor) -> torch.Tensor | int:
        return count_items(target, self.ignore_index)

    def divided(self, loss_fn: Callable, denominator: torch.Tensor, items: torch.Tensor, output, target,
                loss=None) -> torch.Tensor:
        smoothing = {"label_smoothing": self.label_smoothing} if self.label_smoothing else {}
        summed = self.function(prediction(output), target, ignore_index=self.ignore_index, reduction="sum",
                               **smoothing)
        return summed / denominator


class ModelMeanItems(ItemCounting):
    """A transformers model of a counted family whose forward computes its mean itself: the mean times the count."""

    def __init__(self, shifted: bool):
        self.shifted = shifted

    def count(self, target: torch.Tensor) -> torch.Tensor | int:
        return super().count(target[..., 1:] if self.shifted else target)


class ModelItems(ModelMeanItems):
    """A transformers model whose forward divides its summed loss by `num_items_in_batch`."""

    uses_batch_items = False

    def inputs(self, inputs: Any, denominator: torch.Tensor) -> Any:
        return {**inputs, NUM_ITEMS: denominator}

    def divided_loss(self, loss_fn: Callable, denominator: torch.Tensor, items: torch.Tensor) -> Callable:
        return loss_fn

    def divided(self, loss_fn: Callable, denominator: torch.Tensor, items: torch.Tensor, output, target,
                loss=None) -> torch.Tensor:
        return loss_fn(output, target) if loss is None else loss


class OwnItems(ItemCounting):
    """A user's loss that says how many items its mean is over (`item_count(target)`)."""

    def __init__(self, loss_fn):
        self.loss_fn = loss_fn

    def count(self, target) -> torch.Tensor:
        return torch.as_tensor(self.loss_fn.item_count(target), device=_device(target))


def count_items(target: torch.Tensor, ignore_index: int) -> torch.Tensor | int:
    """How many targets differ from `ignore_index`: for targets in host memory an int (numpy counts them in a few
    microseconds, torch's two operations cost 20 on a CPU), else a 0-dim tensor on their device (not read back, so
    an accelerator's queue does not wait)."""
    if target.device.type == "cpu":
        return int(np.count_nonzero(target.numpy() != ignore_index))
    return torch.count_nonzero(target != ignore_index)


def item_counting(loss_fn: Callable, net: nn.Module | None = None) -> ItemCounting | None:
    """How `loss_fn` (on `net`, for loss="model") counts its items; None: a per-batch mean (see the module)."""
    if isinstance(loss_fn, ModelLoss):
        return None if net is None else _model_counting(net)
    if callable(getattr(loss_fn, "item_count", None)):
        return OwnItems(loss_fn)
    if isinstance(loss_fn, CLASS_INDEX_LOSSES):
        if loss_fn.weight is not None or loss_fn.reduction != "mean":
            return None
        function = F.cross_entropy if isinstance(loss_fn, nn.CrossEntropyLoss) else F.nll_loss
        return ClassIndexItems(function, loss_fn.ignore_index, getattr(loss_fn, "label_smoothing", 0.0))
    if isinstance(loss_fn, functools.partial) and loss_fn.func in (F.cross_entropy, F.nll_loss) and not loss_fn.args:
        keywords = {**_defaults(loss_fn.func), **loss_fn.keywords}
        if keywords.get("weight") is not None or keywords.get("reduction") != "mean":
            return None
        return ClassIndexItems(loss_fn.func, keywords["ignore_index"], keywords.get("label_smoothing", 0.0))
    return None


def _model_counting(net: nn.Module) -> ItemCounting | None:
    """A transformers model whose forward hands `num_items_in_batch` to transformers' loss of a counted family; else
    one of a counted family by its class's name (GPT2LMHeadModel's loss is the causal LM's: the first case only);
    None for any other net."""
    model = _innermost(net)
    kind = next((kind for kind in type(model).__mro__ if kind.__module__.startswith("transformers.")), None)
    if kind is None:
        return None
    if _divides_itself(model):
        from transformers.loss.loss_utils import LOSS_MAPPING  # loaded with the model already
        family = next((name for name in MODEL_FAMILIES if LOSS_MAPPING.get(name) is model.loss_function), None)
        return None if family is None else ModelItems(MODEL_FAMILIES[family])
    family = next((name for name in MODEL_FAMILIES if kind.__name__.endswith(name)), None)
    return None if family is None else ModelMeanItems(MODEL_FAMILIES[family])


def _divides_itself(model: nn.Module) -> bool:
    """Whether the model's forward hands its keyword arguments (`num_items_in_batch`) to its `loss_function`."""
    try:
        source = inspect.getsource(type(model).forward)
    except (OSError, TypeError):
        return False
    return "self.loss_function(" in source and hasattr(model, "loss_function")


def _innermost(net: nn.Module) -> nn.Module:
    """The user's module inside the wrappers a strategy put around it (DDP, DeepSpeed's engine, ...: a library's
    module holding it as `module`)."""
    while type(net).__module__.startswith(WRAPPER_LIBRARIES) and isinstance(getattr(net, "module", None), nn.Module):
        net = net.module
    return net


def _defaults(function: Callable) -> dict:
    return {name: p.default for name, p in inspect.signature(function).parameters.items()
            if p.default is not inspect.Parameter.empty}


def _device(target) -> torch.device:
    return target.device if isinstance(target, torch.Tensor) else torch.device("cpu")


def refuse_weights(loss_fn: Callable, target: Any) -> None:
    """Sample and class weights weigh samples; a loss over counted items averages over items, and easyfit defines
    no mix of the two: say so on the first batch, before any step."""
    counting = item_counting(loss_fn)
    if counting is not None and counting.applies(target):
        raise ValueError("sample_weight / class_weight weigh whole samples, but this loss averages over counted items "
                         "(targets other than its ignore index), and a weighted mix of the two is not defined. "
                         "Leave the weights out, or give a loss of your own that weighs the items itself and says "
                         "how many it averages over (a method item_count(target), see docs/api.md).")

