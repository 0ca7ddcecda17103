"""A strategy of your own: data parallelism by hand, registered as the built-in strategies are and used by name
(`fit(strategy="allreduce")`; an object, `strategy=AllReduceStrategy()`, works too).

Run:  python examples/custom_strategy.py        # 2 CPU processes; prints the largest weight difference from
                                                # plain PyTorch trained on the combined batch

`ParallelStrategy` brings the process group, the ranks, the samplers, the collectives and the launcher (the
script is re-run for the other ranks); this strategy adds only what makes it data-parallel: the same initial
weights everywhere, and gradients averaged over the processes after each backward, unless the loop asks for
no synchronisation (a gradient-accumulation micro-step).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

import easyfit
from easyfit.strategies import Fit, ParallelStrategy


@dataclass(kw_only=True)
class AllReduceFit(Fit):
    """What one fit holds on a rank besides its net and optimizer: the parameters whose gradients are averaged, and
    whether this step averages them."""
    trained_parameters: list
    synchronise: bool = True


class AllReduceStrategy(ParallelStrategy):
    """Rank 0's weights broadcast at setup; gradients all-reduced and averaged after every synchronised backward."""

    name = "allreduce"

    def setup(self, net, optimizer, scheduler=None, settings=None, call=None):
        net = super().setup(net, optimizer, scheduler, settings, call).net   # moved to this rank's device
        for tensor in [*net.parameters(), *net.buffers()]:
            dist.broadcast(tensor.data, src=0)
        return AllReduceFit(strategy=self, net=net, optimizer=optimizer, scheduler=scheduler, call=call,
                            trained_parameters=[p for p in net.parameters() if p.requires_grad])

    def backward(self, fit, loss, precision):
        super().backward(fit, loss, precision)
        if not fit.synchronise:
            return
        for param in fit.trained_parameters:
            if param.grad is None:   # unused in this step: a zero gradient keeps every rank's reduce in step
                param.grad = torch.zeros_like(param)
            dist.all_reduce(param.grad)
            param.grad /= self.world_size

    @contextlib.contextmanager
    def no_sync(self, fit):
        fit.synchronise = False
        try:
            yield
        finally:
            fit.synchronise = True


easyfit.strategies.register(AllReduceStrategy)   # fit(strategy="allreduce"), as the built-in names


def plain_pytorch(x, y, lr: float, batch_size: int, epochs: int) -> nn.Module:
    """The same training written by hand, in one process, on the combined batch."""
    net = make_net()
    optimizer = torch.optim.SGD(net.parameters(), lr=lr)
    for _ in range(epochs):
        for start in range(0, len(x), batch_size):
            optimizer.zero_grad()
            nn.functional.cross_entropy(net(x[start:start + batch_size]), y[start:start + batch_size]).backward()
            optimizer.step()
    return net


def make_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 3))


def main() -> None:
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(256, 8, generator=generator)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0.5).long()
    net = make_net()
    model = easyfit.Model(net, "cross_entropy", "sgd", lr=0.1)
    model.fit(x, y, epochs=3, batch_size=16, shuffle=False, lr_scaling=None, verbose=0,
              devices=2, accelerator="cpu", strategy="allreduce")
    if model.is_global_zero:
        reference = plain_pytorch(x, y, lr=0.1, batch_size=32, epochs=3).state_dict()
        difference = max((net.state_dict()[name] - value).abs().max().item() for name, value in reference.items())
        print(f"max weight difference from plain PyTorch: {difference:.3g}")


if __name__ == "__main__":
    main()
