"""DDP2: one process per node; DataParallel over the node's GPUs, gradients all-reduced across nodes.

Each node's process sees a whole per-node batch (split over its GPUs by DataParallel), so the effective batch is
batch_size × num_nodes. Works on CPU too (one device per node), which is how it is tested.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.distributed as dist

from easyfit.distributed.strategies.capabilities import Capabilities
from easyfit.distributed.strategies.parallel import ParallelStrategy
from easyfit.distributed.strategies.states import Fit
from easyfit.parts.precision import Precision


def average_gradients(params: list[torch.Tensor], size: int, group=None) -> None:
    """Average the gradients over the `size` ranks of `group` as one flat buffer. A parameter this rank did not use
    gets a zero gradient, so every rank reduces a buffer of the same layout."""
    for param in params:
        if param.grad is None:
            param.grad = torch.zeros_like(param)
    grads = [p.grad for p in params]
    if not grads:
        return
    flat = torch._utils._flatten_dense_tensors(grads)
    dist.all_reduce(flat, group=group)
    flat /= size
    for grad, synced in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
        grad.copy_(synced)


@dataclass(kw_only=True)
class DDP2Fit(Fit):
    """A DDP2 fit: the parameters whose gradients are averaged, and whether this backward averages them (not in an
    accumulation micro-step)."""

    params: list[torch.nn.Parameter]
    sync_gradients: bool = True


class DDP2Strategy(ParallelStrategy):
    """Ranks are nodes. Parameters are broadcast from rank 0 at setup; gradients are averaged after each backward."""

    name = "ddp2"
    #: one process per node, started by hand, torchrun or SLURM; it uses the node's devices as asked
    capabilities = Capabilities(uses_launcher_processes=False)

    def configure(self, *args, **kwargs) -> None:
        super().configure(*args, **kwargs)
        self.node_devices = self.parallel_devices
        self.parallel_devices = self.parallel_devices[:1]   # one process per node, rooted at the first device
        self.freeze(self.read_placement())   # of one process per node

    def start_launcher(self) -> None:
        return None   # one process per node: started by hand, torchrun or SLURM on each node

    def processes_per_node(self, call) -> int:
        return 1

    def describe_batch_factor(self) -> str:
        return "nodes" if self.batch_factor != 1 else "node"

    def setup(self, net: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler=None, settings=None,
              call=None) -> DDP2Fit:
        net = super().setup(net, optimizer, scheduler, settings, call).net
        for tensor in [*net.parameters(), *net.buffers()]:
            dist.broadcast(tensor.data, src=0)
        params = [p for p in net.parameters() if p.requires_grad]
        if len(self.node_devices) > 1:
            net = torch.nn.DataParallel(net, device_ids=[d.index for d in self.node_devices])
        return DDP2Fit(strategy=self, net=net, optimizer=optimizer, scheduler=scheduler, call=call, params=params)

    def backward(self, fit: DDP2Fit, loss: torch.Tensor, precision: Precision) -> None:
        super().backward(fit, loss, precision)
        if fit.sync_gradients:   # all-reduced as one flat buffer, then divided by the number of nodes
            average_gradients(fit.params, self.world_size)

    @contextlib.contextmanager
    def no_sync(self, fit: DDP2Fit):
        fit.sync_gradients = False
        try:
            yield
        finally:
            fit.sync_gradients = True
