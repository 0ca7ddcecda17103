"""The batches of a call with loss="model": the targets go into the net's forward, as a transformers model takes
them (`labels=`), and stay beside the inputs for the metrics.

A dict batch passes every entry by name, its target (the key "labels", "label", "y", "target" or "targets") under
its own key when the forward names that argument, else as `labels=`, or, for a forward without `labels`, under the
one of those names it takes (`forward(idx, targets=None)`: `targets=`); an `(x, y)` batch (in-memory arrays) passes
`x` as the forward's first argument and `y` as a dict's target goes. Each batch becomes `(inputs, target)`, so
every step, eager or compiled, on any strategy, calls `net(**inputs)` with the targets in it."""
from __future__ import annotations

import inspect
from typing import Any

import torch

from easyfit.data.contents import TARGET_KEYS, split_batch
from easyfit.data.source import BatchSource, WrappedBatches
from easyfit.parts.outputs import ModelLoss

#: the forward's argument a target goes to when the forward does not name the batch's own key
LABELS = "labels"


def targets_in_forward(batches: BatchSource, net: torch.nn.Module, loss_fn) -> BatchSource:
    """`batches` with their targets passed into the forward when the loss is the net's own; else as they are."""
    return TargetsInForward(batches, ForwardArguments(net)) if isinstance(loss_fn, ModelLoss) else batches


class ForwardArguments:
    """The names the net's forward takes: where each input and the targets go."""

    def __init__(self, net: torch.nn.Module):
        self.net_name = type(net).__name__
        try:
            parameters = list(inspect.signature(net.forward).parameters.values())
        except (TypeError, ValueError):
            parameters = []
        self.names = [p.name for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
        self.positional = [p.name for p in parameters if p.kind == p.POSITIONAL_OR_KEYWORD]
        self.any_keyword = any(p.kind == p.VAR_KEYWORD for p in parameters)

    def target_key(self, key: str | None) -> str:
        """The forward's argument for a target the batch holds under `key` (None: an (x, y) batch): that key, else
        `labels`, else the one target name the forward takes, else `labels` into its **kwargs."""
        if key is not None and key in self.names:
            return key
        named = [name for name in TARGET_KEYS if name in self.names]
        if LABELS in self.names or (self.any_keyword and not named):
            return LABELS
        if len(named) == 1:
            return named[0]
        takes = f"several target arguments ({', '.join(named)})" if named else "no target argument " \
            f"({' / '.join(TARGET_KEYS)})"
        raise ValueError(f"loss='model' passes the targets into the net's forward, but {self.net_name}.forward takes "
                         f"{takes}; it takes {', '.join(self.names) or 'none by name'}. Give the forward one "
                         "argument for the targets (labels= or targets=), or pass a loss by name, e.g. "
                         "loss='cross_entropy', which takes the net's output without targets.")

    def input_names(self, count: int) -> list[str]:
        """The forward's names for `count` positional inputs."""
        if count > len(self.positional):
            raise ValueError(f"loss='model' passes every input by name, but {self.net_name}.forward names only "
                             f"{len(self.positional)} positional argument(s) for {count} inputs; pass the inputs "
                             "as a dict (or a dataset of dicts) keyed by the forward's argument names.")
        return self.positional[:count]


class TargetsInForward(WrappedBatches):
    """Batches as `(inputs with the targets, target)` (see the module's docstring)."""

    def __init__(self, batches: BatchSource, arguments: ForwardArguments):
        super().__init__(batches)
        self.arguments = arguments

    @property
    def loader(self):
        return getattr(self.batches, "loader", None)

    def __iter__(self):
        return map(self.structured, self.batches)

    def structured(self, batch: Any) -> tuple[dict, Any]:
        if isinstance(batch, dict):
            key = next((key for key in TARGET_KEYS if key in batch), None)
            if key is None:
                raise ValueError(f"loss='model' passes the targets into the net's forward, but a batch holds no "
                                 f"target: its keys are {', '.join(map(repr, batch))}. Give it a 'labels' entry "
                                 "(for a causal language model, labels=input_ids).")
            inputs = {name: value for name, value in batch.items() if name != key}
            return {**inputs, self.arguments.target_key(key): batch[key]}, batch[key]
        inputs, target = split_batch(batch)
        if target is None:
            raise ValueError("loss='model' passes the targets into the net's forward, but the batches hold inputs "
                             "only: pass y, or batches (x, y) / dicts with a 'labels' entry.")
        if not isinstance(inputs, dict):
            inputs = inputs if isinstance(inputs, tuple) else (inputs,)
            inputs = dict(zip(self.arguments.input_names(len(inputs)), inputs))
        return {**inputs, self.arguments.target_key(None): target}, target
