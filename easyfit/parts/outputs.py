"""What a net's output holds for easyfit: the prediction that metrics, `predict` and a loss given by name take, and
the loss a net computes itself (loss="model").

The rule for structured outputs (a dict, a transformers `ModelOutput`, a named tuple): the prediction is the entry
`logits`; without one, the one tensor entry besides `loss`; otherwise the output as it is (a loss of your own takes
it whole). A tensor is its own prediction. The net's own loss is the entry `loss`, or the last of a plain
`(prediction, loss)` tuple (as a `forward(x, targets=None)` returns)."""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

PREDICTION_KEY = "logits"
LOSS_KEY = "loss"


def entries(output: Any) -> Mapping | None:
    """The named entries of a structured output (a mapping, a ModelOutput, a named tuple); None for anything else."""
    if isinstance(output, Mapping):
        return output
    if isinstance(output, tuple) and hasattr(output, "_asdict"):
        return output._asdict()
    return None


def prediction(output: Any) -> Any:
    """The prediction in the net's output, by the rule of this module."""
    if isinstance(output, torch.Tensor):
        return output
    named = entries(output)
    if named is None:
        return output
    if isinstance(named.get(PREDICTION_KEY), torch.Tensor):
        return named[PREDICTION_KEY]
    tensors = [value for key, value in named.items() if key != LOSS_KEY and isinstance(value, torch.Tensor)]
    return tensors[0] if len(tensors) == 1 else output


def own_loss(output: Any) -> torch.Tensor:
    """The loss the net computed itself (loss="model"): its output's `loss` entry, or a (prediction, loss) tuple's."""
    named = entries(output)
    loss = named.get(LOSS_KEY) if named is not None else getattr(output, LOSS_KEY, _paired_loss(output))
    if isinstance(loss, torch.Tensor):
        return loss
    what = f"{type(output).__name__} with entries {', '.join(map(repr, named))}" if named is not None else \
        type(output).__name__
    raise ValueError(f"loss='model' trains on the loss the net computes itself, but the net returned a {what} with no "
                     "'loss' tensor (nor is it a (prediction, loss) tuple). Such a net (a transformers model) "
                     "computes it when the targets reach its forward as labels=: give the batches a 'labels' entry, "
                     "or the forward a labels argument. Otherwise pass a loss by name, e.g. loss='cross_entropy'.")


def _paired_loss(output: Any) -> torch.Tensor | None:
    """The loss of a plain `(prediction, loss)` tuple: its last entry, one number; None for any other output."""
    if type(output) is tuple and len(output) == 2 and isinstance(output[1], torch.Tensor) and output[1].numel() == 1:
        return output[1]
    return None


class ModelLoss:
    """loss="model": the targets go into the net's forward (`labels=`, see easyfit.data.model_targets) and the net
    trains on the `loss` its output carries; metrics and predict take the output's prediction (`logits`)."""

    name = "model"

    def __call__(self, output: Any, target: Any = None) -> torch.Tensor:
        return own_loss(output)

    def __repr__(self) -> str:
        return "ModelLoss()"
