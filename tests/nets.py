"""The small nets the tests share (imported by conftest.py and by the GPU tests)."""
from __future__ import annotations

import torch
from torch import nn


def tiny_net(in_features: int = 4, out_features: int = 3, seed: int = 0, dropout: float = 0.0) -> nn.Module:
    """A 2-layer MLP; the same seed gives the same initial weights."""
    torch.manual_seed(seed)
    layers = [nn.Linear(in_features, 8), nn.ReLU()] + ([nn.Dropout(dropout)] if dropout else [])
    return nn.Sequential(*layers, nn.Linear(8, out_features))
