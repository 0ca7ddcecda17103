"""DataParallel: one process drives every local GPU; each batch is split across them and the outputs gathered."""
from __future__ import annotations

import torch

from easyfit.distributed.strategies.base import Strategy
from easyfit.distributed.strategies.capabilities import Capabilities


def require_cuda(strategy_name: str) -> None:
    if not torch.cuda.is_available():
        raise RuntimeError(f"strategy={strategy_name!r} splits each batch across CUDA GPUs, and torch sees none here. "
                           "On CPU use strategy='ddp' with devices=N (N processes), or strategy='auto'.")


class DataParallelStrategy(Strategy):
    """torch.nn.DataParallel over `parallel_devices`. The loss is computed on the gathered full-batch output,
    so losses and metrics see the whole batch. One process: the batch factor is 1."""

    name = "dp"
    capabilities = Capabilities(uses_launcher_processes=False)

    def __init__(self, parallel_devices: list[torch.device] | None = None):
        super().__init__(parallel_devices[0] if parallel_devices else None)
        self.parallel_devices = parallel_devices

    def configure(self, accelerator: str = "cuda", parallel_devices: list[torch.device] | None = None,
                  **settings) -> None:
        self.parallel_devices = self.parallel_devices or parallel_devices
        super().configure(accelerator, self.parallel_devices, **settings)

    @property
    def batch_factor(self) -> int:
        return 1

    def describe_batch_factor(self) -> str:
        return f"process (split over {len(self.parallel_devices)} GPUs)"

    def check_call(self, call) -> None:
        require_cuda(self.name)
        if call.num_nodes > 1:
            raise ValueError("strategy='dp' runs in one process on one node; for several nodes use 'ddp', or 'ddp2' "
                             "(DataParallel inside each node, DDP across nodes)")

    def setup(self, net: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler=None, settings=None, call=None):
        fit = super().setup(net, optimizer, scheduler, settings, call)
        fit.net = torch.nn.DataParallel(fit.net, device_ids=[d.index for d in self.parallel_devices])
        return fit
