"""The hand-written side: torchrun + DistributedDataParallel, written the fast way a careful user writes it.

Started by benchmarks/ddp.py as `python -m torch.distributed.run --nproc-per-node 2 hand.py OUT ...`.
Each rank takes its share of a per-epoch permutation of the in-memory tensors and indexes whole batches out.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from common import BATCH_SIZE, LR, StepClock, make_data, make_net, parse_args
from torch.nn.parallel import DistributedDataParallel


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    x, y = make_data(world_size, args.steps_per_epoch)
    net = DistributedDataParallel(make_net())
    optimizer = torch.optim.SGD(net.parameters(), lr=LR)
    clock = StepClock(args.warmup)
    for epoch in range(args.epochs):
        order = torch.randperm(len(x), generator=torch.Generator().manual_seed(epoch))[rank::world_size]
        for start in range(0, len(order), BATCH_SIZE):
            clock.step_begins()
            idx = order[start:start + BATCH_SIZE]
            loss = F.cross_entropy(net(x[idx]), y[idx])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
    clock.training_ends()
    if rank == 0:
        clock.write(args.out, world_size)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
