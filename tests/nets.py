"""The small nets (and a metric) the tests share (imported by conftest.py, the GPU tests and others)."""
from __future__ import annotations

import pytest
import torch
from torch import nn


def tiny_net(in_features: int = 4, out_features: int = 3, seed: int = 0, dropout: float = 0.0) -> nn.Module:
    """A 2-layer MLP; the same seed gives the same initial weights."""
    torch.manual_seed(seed)
    layers = [nn.Linear(in_features, 8), nn.ReLU()] + ([nn.Dropout(dropout)] if dropout else [])
    return nn.Sequential(*layers, nn.Linear(8, out_features))


def mean_of_batch_maxima():
    """A user's torchmetrics metric whose value depends on how the samples are batched (one batch of all samples
    would differ); the calling test skips where torchmetrics is not installed (easyfit itself does not need it)."""
    torchmetrics = pytest.importorskip("torchmetrics")

    class MeanOfBatchMaxima(torchmetrics.Metric):
        def __init__(self):
            super().__init__()
            self.add_state("total", torch.tensor(0.0), dist_reduce_fx="sum")
            self.add_state("batches", torch.tensor(0.0), dist_reduce_fx="sum")

        def update(self, output: torch.Tensor, target) -> None:
            self.total += output.max()
            self.batches += 1

        def compute(self) -> torch.Tensor:
            return self.total / self.batches

    return MeanOfBatchMaxima()
