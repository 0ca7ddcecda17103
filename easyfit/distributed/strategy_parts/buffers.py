"""A net's buffers made the same on every rank at the end of a fit: BatchNorm's running statistics, which each rank
updates from its own batches, become rank 0's (the ones rank 0's checkpoints hold)."""
from __future__ import annotations

import torch


def share_rank_zero_buffers(strategy, net: torch.nn.Module | None) -> None:
    """Put rank 0's buffers of `net` into every rank's, bit for bit. Every rank calls it: one gather of the buffers'
    bytes through `strategy` on its `root_device`; nothing to do in one process, or for a net without buffers."""
    buffers = [] if net is None or strategy.world_size == 1 else \
        [buffer for buffer in net.buffers() if buffer.device.type != "meta" and buffer.numel()]
    if not buffers:
        return
    mine = torch.cat([buffer.detach().contiguous().reshape(-1).view(torch.uint8) for buffer in buffers])
    first = strategy.all_gather(mine.to(strategy.root_device))[0]
    sizes = [buffer.numel() * buffer.element_size() for buffer in buffers]
    for buffer, data in zip(buffers, first.split(sizes)):
        buffer.copy_(data.to(buffer.device, copy=True).view(buffer.dtype).reshape(buffer.shape))
