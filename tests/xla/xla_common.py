"""What the XLA tests share: the data, the net, plain PyTorch's reference run. Imports no torch_xla, so a script
that launches XLA processes can use it before XLA's runtime starts."""
from __future__ import annotations

import torch
from torch import nn

TOLERANCE = 1e-5
ACCUMULATE, CLIP, BATCH, LR = 2, 0.5, 16, 0.05


def data() -> tuple[torch.Tensor, torch.Tensor]:
    """101 samples: an uneven last batch and a last accumulation window of one batch."""
    x = torch.randn(101, 4, generator=torch.Generator().manual_seed(0))
    return x, (x[:, 0] > 0).long() + (x[:, 1] > 0.5).long()


def net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 3))


def plain_pytorch(optimizer_name: str, epochs: int = 2) -> nn.Module:
    """The reference on the CPU: batches in order, gradients of 2 batches averaged, clipped to 0.5, then a step."""
    model, (x, y) = net(), data()
    optimizer = getattr(torch.optim, optimizer_name)(model.parameters(), lr=LR)
    starts = list(range(0, len(x), BATCH))
    for _ in range(epochs):
        for step, start in enumerate(starts):
            if step % ACCUMULATE == 0:
                optimizer.zero_grad()
            loss = nn.functional.cross_entropy(model(x[start:start + BATCH]), y[start:start + BATCH])
            (loss / ACCUMULATE).backward()
            if (step + 1) % ACCUMULATE == 0 or step + 1 == len(starts):
                nn.utils.clip_grad_norm_(model.parameters(), CLIP)
                optimizer.step()
    return model


def largest_difference(first: nn.Module, second: nn.Module) -> float:
    pairs = zip(first.state_dict().values(), second.state_dict().values())
    return max((a.cpu() - b.cpu()).abs().max().item() for a, b in pairs)
