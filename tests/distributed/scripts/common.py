"""Data and net shared by the distributed test scripts and the single-process reference they are compared with."""
import torch
from torch import nn

NUM_SAMPLES = 128


def make_data():
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(NUM_SAMPLES, 6, generator=generator)
    y = (x[:, 0] + x[:, 1] > 0).long() + (x[:, 2] > 1).long()
    return x, y


def make_net() -> nn.Module:
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))


def make_pipeline_net() -> nn.Module:
    """Four layers (a pipeline of 2 stages takes 2 each); the last is a block of two."""
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Sequential(nn.Tanh(), nn.Linear(16, 3)))
