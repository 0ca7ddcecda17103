"""The dispatcher: (strategy, devices, accelerator, num_nodes, environment) -> Strategy."""
from __future__ import annotations

import torch

from easyfit.distributed.strategies.base import Strategy
from easyfit.distributed.strategies.single import SingleDeviceStrategy
from easyfit.losses import closest_name

ACCELERATORS = ("auto", "cpu", "gpu", "cuda", "mps")
BUILT = {"auto", "single"}
PLANNED = ("ddp", "ddp_spawn", "ddp_fork", "ddp_notebook", "dp", "ddp2", "horovod", "bagua",
           "ddp_sharded", "fsdp", "deepspeed")


def resolve_accelerator(accelerator: str) -> str:
    key = str(accelerator).lower()
    if key not in ACCELERATORS:
        raise ValueError(f"unknown accelerator {accelerator!r}.{closest_name(key, ACCELERATORS)} "
                         f"Valid values: {', '.join(ACCELERATORS)}.")
    if key == "auto":
        if torch.cuda.is_available():
            return "cuda"
        return "mps" if torch.backends.mps.is_available() else "cpu"
    if key in ("gpu", "cuda") and not torch.cuda.is_available():
        raise RuntimeError(f"accelerator={accelerator!r} was asked for, but torch sees no CUDA GPU here "
                           f"(torch {torch.__version__}). Use accelerator='cpu' or 'auto'.")
    if key == "mps" and not torch.backends.mps.is_available():
        raise RuntimeError("accelerator='mps' was asked for, but MPS is not available; use 'cpu' or 'auto'")
    return "cuda" if key == "gpu" else key


def connect(strategy="auto", devices="auto", accelerator="auto", num_nodes=1, process_group_backend=None) -> Strategy:
    if isinstance(strategy, Strategy):
        return strategy
    key = str(strategy).lower()
    if key not in BUILT:
        if key in PLANNED:
            raise NotImplementedError(f"strategy {strategy!r} is not built yet; use 'auto' or 'single'")
        raise ValueError(f"unknown strategy {strategy!r}.{closest_name(key, sorted(BUILT) + list(PLANNED))} "
                         f"Valid names: {', '.join(sorted(BUILT) + list(PLANNED))}.")
    kind = resolve_accelerator(accelerator)
    return SingleDeviceStrategy(torch.device(kind, 0) if kind == "cuda" else torch.device(kind))
