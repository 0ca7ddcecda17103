"""Shared by the vision tests and their ddp script: PNG files in class folders read by torchvision's ImageFolder
through transforms v2 (with augmentation), the nets (torchvision's ResNet-18, a small timm model), and the plain
loop the fits are compared with.

Each sample's augmentation draws from a generator seeded by its index (`Seeded`), so a sample is the same in any
process, loader worker or order: the fit and the loop see the same batches."""
from __future__ import annotations

import os

import numpy as np
import torch
from torch import nn
from torch.utils.data import Dataset

CLASSES, PER_CLASS, SIZE = 10, 4, 32
BATCH, STEPS, LR = 8, 2, 0.01
NETS = ("resnet18", "timm_resnet10t")


def write_images(folder: str) -> None:
    """PER_CLASS PNG images of SIZE² pixels in each of CLASSES class folders (each class its own colour bias)."""
    from PIL import Image
    generator = np.random.default_rng(0)
    for label in range(CLASSES):
        os.makedirs(os.path.join(folder, f"class{label}"), exist_ok=True)
        for index in range(PER_CLASS):
            pixels = generator.integers(0, 256, (SIZE, SIZE, 3)) // 2 + label * 12
            Image.fromarray(pixels.astype(np.uint8)).save(os.path.join(folder, f"class{label}", f"{index}.png"))


class Seeded(Dataset):
    """`dataset[i]` with torch's random numbers (what transforms v2 draw) seeded by i."""

    def __init__(self, dataset: Dataset):
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(index)
            return self.dataset[index]


def images(folder: str, augment: bool) -> Dataset:
    """The ImageFolder at `folder`, as float tensors normalised per channel; with `augment`, random crops and flips
    (seeded per sample)."""
    from torchvision import datasets
    from torchvision.transforms import v2
    steps = [v2.ToImage(), v2.ToDtype(torch.float32, scale=True)]
    if augment:
        steps += [v2.RandomResizedCrop(SIZE, scale=(0.6, 1.0), antialias=True), v2.RandomHorizontalFlip()]
    steps.append(v2.Normalize([0.5, 0.5, 0.5], [0.25, 0.25, 0.25]))
    return Seeded(datasets.ImageFolder(folder, transform=v2.Compose(steps)))


def make_net(name: str) -> nn.Module:
    torch.manual_seed(0)
    if name == "resnet18":
        import torchvision
        return torchvision.models.resnet18(weights=None, num_classes=CLASSES)
    import timm
    return timm.create_model("resnet10t", pretrained=False, num_classes=CLASSES)


def plain_loop(name: str, dataset: Dataset, processes: int = 1) -> nn.Module:
    """SGD for STEPS steps over the samples in order, BATCH × `processes` a step, as DDP computes it on
    `processes` ranks (rank r takes every processes-th sample): the mean of the ranks' mean losses, each rank's
    BatchNorm normalising over its own share, and the running statistics rank 0's (DDP broadcasts its buffers)."""
    net = make_net(name).train()
    optimizer = torch.optim.SGD(net.parameters(), lr=LR)
    per_step = BATCH * processes
    for step in range(STEPS):
        samples = [dataset[i] for i in range(step * per_step, (step + 1) * per_step)]
        losses = []
        for rank in reversed(range(processes)):   # rank 0 last: its statistics are the ones kept
            buffers = {key: value.clone() for key, value in net.named_buffers()}
            share = samples[rank::processes]
            x, y = torch.stack([s[0] for s in share]), torch.tensor([s[1] for s in share])
            losses.append(nn.functional.cross_entropy(net(x), y))
            if rank:   # new tensors, not copies into the old ones, which the backward still reads
                for key, value in buffers.items():
                    module, _, buffer = key.rpartition(".")
                    net.get_submodule(module)._buffers[buffer] = value
        optimizer.zero_grad()
        (sum(losses) / processes).backward()
        optimizer.step()
    return net.eval()
