"""Loss functions by name, with a first-batch check that the targets suit the loss."""
from __future__ import annotations

import inspect
from typing import Callable

import torch
from torch import nn
from torch.nn import functional as F

from easyfit.parts.outputs import ModelLoss, prediction
from easyfit.utils.checks import closest_name


def _taking_predictions(loss_class: type) -> type:
    """`loss_class` (a torch loss) called on the prediction in the net's output: a tensor as it is, the `logits` of
    a transformers ModelOutput, a dict or a named tuple (easyfit.parts.outputs). The class keeps its name and is a
    subclass, so every check that knows the torch loss knows it; it lives in this module, so it pickles."""
    def forward(self, output, target):
        return loss_class.forward(self, prediction(output), target)
    taking = type(loss_class.__name__, (loss_class,), {"forward": forward, "__module__": __name__,
                                                       "__qualname__": f"NAMED.{loss_class.__name__}"})
    setattr(NAMED, loss_class.__name__, taking)
    return taking


class NAMED:
    """The torch losses easyfit builds by name, each taking the prediction in a structured output."""


_CE, _NLL, _MSE, _L1, _BCE, _BCE_LOGITS, _HUBER, _SMOOTH_L1, _KL, _POISSON, _HINGE = map(_taking_predictions, (
    nn.CrossEntropyLoss, nn.NLLLoss, nn.MSELoss, nn.L1Loss, nn.BCELoss, nn.BCEWithLogitsLoss, nn.HuberLoss,
    nn.SmoothL1Loss, nn.KLDivLoss, nn.PoissonNLLLoss, nn.HingeEmbeddingLoss))

#: loss="model": the net's own loss (easyfit.parts.outputs.ModelLoss), besides the torch losses by name
MODEL = "model"
LOSSES: dict[str, Callable[[], nn.Module]] = {
    "cross_entropy": _CE,
    "categorical_crossentropy": _CE,
    "nll": _NLL,
    "mse": _MSE,
    "mean_squared_error": _MSE,
    "l1": _L1,
    "mae": _L1,
    "mean_absolute_error": _L1,
    "bce": _BCE,
    "binary_crossentropy": _BCE,
    "bce_with_logits": _BCE_LOGITS,
    "huber": _HUBER,
    "smooth_l1": _SMOOTH_L1,
    "kl_div": lambda: _KL(reduction="batchmean"),
    "poisson_nll": _POISSON,
    "hinge_embedding": _HINGE,
}
CLASS_INDEX_LOSSES = (nn.CrossEntropyLoss, nn.NLLLoss)
BINARY_LOSSES = (nn.BCELoss, nn.BCEWithLogitsLoss)
REGRESSION_LOSSES = (nn.MSELoss, nn.L1Loss, nn.HuberLoss, nn.SmoothL1Loss)
OUTPUTS = ("logits", "probabilities", "log_probabilities")
#: what the net's outputs are for each loss that says (a regression loss reads them as values: probabilities)
OUTPUT_KINDS = {
    "logits": ((nn.CrossEntropyLoss, nn.BCEWithLogitsLoss), (F.cross_entropy, F.binary_cross_entropy_with_logits)),
    "log_probabilities": ((nn.NLLLoss, nn.KLDivLoss), (F.nll_loss, F.kl_div)),
    "probabilities": ((nn.BCELoss, *REGRESSION_LOSSES),
                      (F.binary_cross_entropy, F.mse_loss, F.l1_loss, F.huber_loss, F.smooth_l1_loss)),
}


def output_kind(loss_fn) -> str | None:
    """Whether the loss reads the net's outputs as logits, probabilities or log-probabilities; None when it is a
    loss easyfit does not know. A net's own loss (loss="model") gives logits, as transformers models do."""
    if isinstance(loss_fn, ModelLoss):
        return "logits"
    for kind, (classes, functions) in OUTPUT_KINDS.items():
        if isinstance(loss_fn, classes) or any(loss_fn is function for function in functions):
            return kind
    return None


def resolve_loss(loss) -> Callable:
    """A loss name ("model": the net's own), an nn.Module or a callable `(output, target) -> scalar tensor`."""
    if loss is None:
        raise TypeError("loss=None: easyfit needs a loss to train on. For a net that computes its own loss (a "
                        "transformers model given labels=), pass loss='model'; otherwise a name such as "
                        "'cross_entropy', an nn.Module or a callable (output, target) -> tensor.")
    if isinstance(loss, str):
        key = loss.lower()
        if key == MODEL:
            return ModelLoss()
        if key not in LOSSES:
            raise ValueError(f"unknown loss {loss!r}.{closest_name(key, [*LOSSES, MODEL])} "
                             f"Valid names: {', '.join(sorted(LOSSES))} ('model': the loss the net returns itself); "
                             "or pass an nn.Module or a callable.")
        return LOSSES[key]()
    if isinstance(loss, type):
        raise TypeError(f"loss={loss.__name__} is a class; pass an instance, loss={loss.__name__}(), "
                        "or a name such as 'cross_entropy'")
    if callable(loss):
        _check_takes_output_and_target(loss)
        return loss
    raise TypeError("loss must be a name, an nn.Module or a callable (output, target) -> tensor; "
                    f"got {type(loss).__name__}")


def _check_takes_output_and_target(loss: Callable) -> None:
    """A loss is called as loss(output, target): say so now if it cannot be (not after the first forward pass)."""
    try:
        signature = inspect.signature(loss)
    except (TypeError, ValueError):   # a builtin without a signature: the first step will tell
        return
    try:
        signature.bind(None, None)
    except TypeError:
        name = getattr(loss, "__name__", type(loss).__name__)
        raise TypeError(f"the loss is called as loss(output, target), but {name}{signature} cannot take those two "
                        "arguments. Give it that form, e.g. loss=lambda output, target: my_loss(output, target, "
                        "...), or a name such as 'cross_entropy'.") from None


def check_targets(loss_fn: Callable, output, target) -> None:
    """Explain in words when the target's dtype or shape cannot work with the loss (first batch only)."""
    if not isinstance(output, torch.Tensor) or not isinstance(target, torch.Tensor):
        return
    name = type(loss_fn).__name__
    if isinstance(loss_fn, CLASS_INDEX_LOSSES) and target.is_floating_point() and target.shape != output.shape:
        raise TypeError(
            f"{name} expects class indices as targets: an integer tensor of shape {tuple(output.shape[:1])} "
            f"with values in [0, {output.shape[-1] - 1}]; got {target.dtype} targets of shape {tuple(target.shape)}. "
            "Convert them with y.long() (or y.astype('int64') in numpy), or use a regression loss such as 'mse'.")
    if isinstance(loss_fn, CLASS_INDEX_LOSSES) and output.dim() >= 2 and output.shape[1] == 1:
        raise ValueError(
            f"{name} over a single output column is always 0 (a softmax over one class is 1), so nothing would "
            f"train; the net returned shape {tuple(output.shape)}. For regression use loss='mse' (or 'mae', "
            "'huber'); for a binary task with one logit use loss='bce_with_logits' and float 0/1 targets; for "
            "classes give the net one output per class.")
    if isinstance(loss_fn, CLASS_INDEX_LOSSES) and not target.is_floating_point() and output.dim() < 2:
        raise ValueError(f"{name} needs one output per class (shape [batch, classes]); the net returned shape "
                         f"{tuple(output.shape)}. For a single-logit binary output use 'bce_with_logits'.")
    if isinstance(loss_fn, CLASS_INDEX_LOSSES) and not target.is_floating_point():
        if target.dim() == output.dim() and target.shape[-1] == 1:
            raise ValueError(f"{name} expects class indices of shape {tuple(target.shape[:-1])}; got targets of "
                             f"shape {tuple(target.shape)}. Squeeze them in your data: y.view(-1) (in-memory "
                             "arrays are squeezed by fit itself).")
        check_class_range(loss_fn, output.shape[1], target)
    if isinstance(loss_fn, nn.BCELoss) and output.numel() and (output.min() < 0 or output.max() > 1):
        raise ValueError(f"BCELoss needs probabilities in [0, 1], but the net's outputs range over "
                         f"[{float(output.min()):.3g}, {float(output.max()):.3g}]: they look like logits. Use "
                         "loss='bce_with_logits' (it applies the sigmoid itself, more stably), or end the net "
                         "with nn.Sigmoid().")
    if isinstance(loss_fn, BINARY_LOSSES) and not target.is_floating_point():
        raise TypeError(f"{name} expects float targets (0.0 / 1.0) with the output's shape {tuple(output.shape)}; "
                        f"got {target.dtype}. Convert them with y.float().")
    if isinstance(loss_fn, BINARY_LOSSES + REGRESSION_LOSSES) and target.shape != output.shape:
        raise ValueError(
            f"{name} compares output and target element by element, but the output has shape "
            f"{tuple(output.shape)} and the target {tuple(target.shape)}; broadcasting them would give a wrong "
            f"loss. Reshape the target (e.g. y.view({', '.join(['-1'] + [str(s) for s in output.shape[1:]])})) "
            "or the net's output so they match.")


def check_class_range(loss_fn, num_classes: int, target: torch.Tensor) -> None:
    """Class indices must lie in [0, num_classes - 1] (the loss's ignore_index aside); read from one copy on the
    host (an accelerator's queue waits once, and an XLA device's step traces as it will in later epochs)."""
    target = target.cpu()
    labels = target[target != getattr(loss_fn, "ignore_index", -100)]
    if labels.numel() and (labels.min() < 0 or labels.max() >= num_classes):
        bad = int(labels.min()) if labels.min() < 0 else int(labels.max())
        raise ValueError(f"the targets hold class index {bad}, but the net has {num_classes} outputs, so class "
                         f"indices must lie in [0, {num_classes - 1}]. Give the net one output per class, or "
                         "renumber the labels from 0 (e.g. y - y.min() for labels counted from 1).")
