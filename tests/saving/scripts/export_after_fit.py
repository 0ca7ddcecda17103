"""A ddp and an fsdp fit on 2 CPU processes, each followed by `model.export` on every rank, to ONNX and .pt2.

Usage: python export_after_fit.py OUT_DIR
Every rank exports to OUT_DIR/<strategy>-rank<rank>.onnx and .pt2 (only rank 0 may write); rank 0 adds
OUT_DIR/<strategy>-predicted.pt: the inputs and what predict returns for them after the fit.
"""
import os
import sys

import torch
from torch import nn

import easyfit

out = sys.argv[1]
generator = torch.Generator().manual_seed(0)
x = torch.randn(64, 6, generator=generator)
y = (x[:, 0] + x[:, 1] > 0).long()
for strategy in ("ddp", "fsdp"):
    torch.manual_seed(1)
    net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 2))
    model = easyfit.Model(net, "cross_entropy", "sgd", lr=0.1)
    model.fit(x, y, epochs=2, batch_size=8, verbose=0, devices=2, accelerator="cpu", strategy=strategy)
    for suffix in ("onnx", "pt2"):
        model.export(os.path.join(out, f"{strategy}-rank{model.global_rank}.{suffix}"))
    if model.is_global_zero:
        inputs = {n: x[:n] for n in (3, 5)}
        torch.save({n: (batch, model.predict(batch, devices=1, strategy="single")) for n, batch in inputs.items()},
                   os.path.join(out, f"{strategy}-predicted.pt"))
