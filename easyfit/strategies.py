"""The strategy classes, for `fit(strategy=...)` with options: `easyfit.strategies.DDP(find_unused_parameters=True)`.

Each class is imported on first use, so naming a backend here never imports its optional package.
"""
from __future__ import annotations

import importlib

#: public name -> (module, class)
CLASSES = {
    "Strategy": ("easyfit.distributed.strategies.base", "Strategy"),
    "SingleDevice": ("easyfit.distributed.strategies.single", "SingleDeviceStrategy"),
    "DDP": ("easyfit.distributed.strategies.ddp", "DDPStrategy"),
    "ParallelStrategy": ("easyfit.distributed.strategies.parallel", "ParallelStrategy"),
    "DataParallel": ("easyfit.distributed.strategies.dp", "DataParallelStrategy"),
    "DDP2": ("easyfit.distributed.strategies.ddp2", "DDP2Strategy"),
    "Zero": ("easyfit.distributed.strategies.zero", "ZeroStrategy"),
    "FSDP": ("easyfit.distributed.strategies.fsdp", "FSDPStrategy"),
    "ModelParallel": ("easyfit.distributed.strategies.tensor_parallel", "ModelParallelStrategy"),
    "DDPSharded": ("easyfit.distributed.strategies.fairscale", "ShardedStrategy"),
    "DeepSpeed": ("easyfit.distributed.strategies.deepspeed", "DeepSpeedStrategy"),
    "Horovod": ("easyfit.distributed.strategies.horovod", "HorovodStrategy"),
    "Bagua": ("easyfit.distributed.strategies.bagua", "BaguaStrategy"),
    "Pipeline": ("easyfit.distributed.strategies.pipeline", "PipelineStrategy"),
    "XLA": ("easyfit.distributed.strategies.xla", "XLAStrategy"),
}
__all__ = list(CLASSES)


def __getattr__(name: str):
    if name not in CLASSES:
        raise AttributeError(f"module 'easyfit.strategies' has no attribute {name!r}; "
                             f"available: {', '.join(CLASSES)}")
    module, attribute = CLASSES[name]
    return getattr(importlib.import_module(module), attribute)


def __dir__() -> list[str]:
    return __all__
