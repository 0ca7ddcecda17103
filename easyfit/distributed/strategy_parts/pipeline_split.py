"""How the pipeline strategy cuts an nn.Sequential into stages: the options checked, the balance (layers per stage,
given or chosen from parameter counts), each stage's layers under their names in the whole net (so state dicts keep
the keys a plain nn.Sequential loads), and activation checkpointing per micro-batch."""
from __future__ import annotations

from collections import OrderedDict

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")
CHECKPOINTS = ("never", "except_last", "always")


def check_options(balance, microbatches, schedule: str, checkpoint_policy: str, stages) -> None:
    """The strategy's own options, before any process starts."""
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {schedule!r}; choose one of {', '.join(SCHEDULES)}")
    if checkpoint_policy not in CHECKPOINTS:
        raise ValueError(f"checkpoint must be one of {', '.join(CHECKPOINTS)}, got {checkpoint_policy!r}")
    if microbatches is not None and (not isinstance(microbatches, int) or microbatches < 1):
        raise ValueError(f"microbatches must be a positive int, got {microbatches!r}")
    if stages is not None and (not isinstance(stages, int) or stages < 1):
        raise ValueError(f"stages (processes per pipeline) must be a positive int, got {stages!r}")
    if balance != "auto":
        if not isinstance(balance, (list, tuple)) or not balance or \
                not all(isinstance(count, int) and count >= 1 for count in balance):
            raise ValueError(f"balance must be 'auto' or a list of layers per stage (positive ints), e.g. [2, 2]; "
                             f"got {balance!r}")


def layers_of(net: nn.Module) -> list[tuple[str, nn.Module]]:
    """The net's layers in order, by name; the net must be an nn.Sequential."""
    if not isinstance(net, nn.Sequential):
        raise TypeError(f"strategy='pipeline' splits an nn.Sequential into stages, layers in order, but the net is "
                        f"a {type(net).__name__}. Write the net as nn.Sequential(layer, layer, ...) (a block of "
                        "several layers may be one nn.Sequential element), or train it with strategy='fsdp', which "
                        "shards any module.")
    return list(net.named_children())


def auto_balance(layers: list[tuple[str, nn.Module]], stages: int) -> list[int]:
    """Layers per stage so that each stage's parameter count is as close to an equal share as contiguous cuts allow
    (a layer without parameters counts as one parameter, so no stage is left empty)."""
    if stages > len(layers):
        raise _too_many_stages(stages, len(layers))
    weights = [max(sum(p.numel() for p in layer.parameters()), 1) for _, layer in layers]
    prefix = [sum(weights[:end]) for end in range(len(weights) + 1)]
    cuts = [0]
    for stage in range(1, stages):
        target = prefix[-1] * stage / stages
        allowed = range(cuts[-1] + 1, len(layers) - (stages - stage) + 1)
        cuts.append(min(allowed, key=lambda end: abs(prefix[end] - target)))
    bounds = [*cuts, len(layers)]
    return [bounds[i + 1] - bounds[i] for i in range(stages)]


def resolve_balance(balance, layers: list[tuple[str, nn.Module]], stages: int) -> list[int]:
    """Layers per stage: the given list, checked against the net, or the automatic one."""
    if balance == "auto":
        return auto_balance(layers, stages)
    balance = list(balance)
    if len(balance) != stages:
        raise ValueError(f"balance {balance} has {len(balance)} entries, but the pipeline has {stages} stages; give "
                         f"one number of layers per stage, or balance='auto'")
    if sum(balance) != len(layers):
        raise ValueError(f"balance {balance} places {sum(balance)} layers, but the nn.Sequential has {len(layers)}; "
                         "the numbers of layers per stage must add up to the net's layers")
    return balance


def _too_many_stages(stages: int, layers: int) -> ValueError:
    return ValueError(f"the pipeline has {stages} stages but the nn.Sequential has only {layers} layers; use at "
                      f"most {layers} stages (fewer processes, or stages= with data-parallel replicas)")


def stage_layers(layers: list[tuple[str, nn.Module]], balance: list[int], stage: int) -> nn.Sequential:
    """Stage `stage`'s layers, as a Sequential that keeps each layer's name in the whole net."""
    start = sum(balance[:stage])
    return nn.Sequential(OrderedDict(layers[start:start + balance[stage]]))


class CheckpointedStage(nn.Module):
    """A stage's layers with torch's activation checkpointing per micro-batch: "always", "except_last" (every
    micro-batch but the step's last, whose backward follows at once) or "never". `start_step(m)` before each step."""

    def __init__(self, layers: nn.Sequential, policy: str):
        super().__init__()
        self.layers, self.policy = layers, policy
        self.microbatches, self.calls = 1, 0

    def start_step(self, microbatches: int) -> None:
        self.microbatches, self.calls = microbatches, 0

    def forward(self, *inputs):
        if not torch.is_grad_enabled() or self.policy == "never":
            return self.layers(*inputs)
        index, self.calls = self.calls, self.calls + 1
        if self.policy == "except_last" and index == self.microbatches - 1:
            return self.layers(*inputs)
        return checkpoint(self.layers, *inputs, use_reentrant=False)
