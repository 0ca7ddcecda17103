"""torchvision's ResNet-18 and a timm model trained by one fit each under ddp on 2 CPU processes.

Usage: python ddp_fit.py OUT_DIR IMAGES_DIR
Rank 0 writes OUT_DIR/<net>.pt: the state dict after the fit.
"""
import os
import sys

import torch

import easyfit

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from vision_common import BATCH, LR, NETS, STEPS, images, make_net

out, folder = sys.argv[1:3]
for name in NETS:
    model = easyfit.Model(make_net(name), "cross_entropy", "sgd", lr=LR)
    model.fit(images(folder, augment=True), batch_size=BATCH, epochs=1, steps_per_epoch=STEPS, shuffle=False,
              lr_scaling=None, verbose=0, num_workers=2, devices=2, accelerator="cpu", strategy="ddp")
    if model.is_global_zero:
        torch.save(model.net.state_dict(), os.path.join(out, f"{name}.pt"))
