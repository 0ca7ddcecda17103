"""How much memory training state needs per device, and how much a device has: the figures strategy="auto" uses to
pick a sharded strategy when a replicated one would not fit."""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

#: optimizer class name -> state tensors it keeps per parameter (each the parameter's size)
STATE_COPIES = {"Adam": 2, "AdamW": 2, "Adamax": 2, "NAdam": 2, "RAdam": 2, "Adadelta": 2, "SparseAdam": 2,
                "Adagrad": 1, "Rprop": 2, "ASGD": 1, "LBFGS": 2}
#: a class not listed above is assumed to keep this many (Adam-like)
UNKNOWN_COPIES = 2
#: the sharded strategy "auto" picks when the replicated state does not fit
SHARDED = "fsdp"


@dataclass(frozen=True)
class TrainingMemory:
    """Bytes of parameters, gradients and optimizer state that one replica of the training state needs."""
    parameters: int
    gradients: int
    optimizer_state: int
    optimizer: str

    @property
    def total(self) -> int:
        return self.parameters + self.gradients + self.optimizer_state


def state_copies(optimizer: torch.optim.Optimizer) -> int:
    """Per-parameter state tensors the optimizer keeps: SGD one with momentum, RMSprop one plus momentum and
    centring, Adam two, ..."""
    name, defaults = type(optimizer).__name__, optimizer.defaults
    if name == "SGD":
        return int(bool(defaults.get("momentum")))
    if name == "RMSprop":
        return 1 + int(bool(defaults.get("momentum"))) + int(bool(defaults.get("centered")))
    return STATE_COPIES.get(name, UNKNOWN_COPIES)


def estimate(net: torch.nn.Module, optimizer: torch.optim.Optimizer) -> TrainingMemory:
    """The training state of `net` under `optimizer` (each parameter counted once, shared ones too)."""
    params = {id(p): p for p in net.parameters()}.values()
    parameters = sum(p.numel() * p.element_size() for p in params)
    trained = sum(p.numel() * p.element_size() for group in optimizer.param_groups for p in group["params"])
    gradients = sum(p.numel() * p.element_size() for p in params if p.requires_grad)
    return TrainingMemory(parameters, gradients, state_copies(optimizer) * trained, type(optimizer).__name__)


def device_memory(accelerator: str, devices: list[torch.device], processes: int) -> int:
    """Memory of the smallest device in bytes; for CPU ranks, the machine's RAM shared by its `processes`."""
    if accelerator == "cuda":
        return min(torch.cuda.get_device_properties(device.index or 0).total_memory for device in devices)
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // max(processes, 1)


def gigabytes(size: int) -> str:
    return f"{size / 1e9:.3g} GB"


def sharding_reason(memory: TrainingMemory, available: int) -> str | None:
    """Why to shard ("model + Adam state 38.2 GB > 24 GB per device: using fsdp"), or None when it fits."""
    if memory.total <= available:
        return None
    return f"model + {memory.optimizer} state {gigabytes(memory.total)} > {gigabytes(available)} per device: " \
           f"using {SHARDED}"
