"""fit(accelerator="tpu", devices=-1) from a script: torch_xla.launch starts one process per XLA device (one on
XLA:CPU) and rank 0's trained state comes back to this process.

Usage: python launch_fit.py OUT   writes OUT/result.pt (the net's weights and the History's losses), then fits a
       net that raises in its forward inside the launched process: the script ends with that error."""
from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch import nn
from xla_common import ACCUMULATE, BATCH, CLIP, LR, data, net

import easyfit


class Broken(nn.Module):
    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(4, 3)

    def forward(self, x):
        raise ValueError("this net's forward fails in the launched process")


def fit(net: nn.Module) -> easyfit.Model:
    model = easyfit.Model(net, "cross_entropy", "adam", lr=LR)
    model.fit(*data(), epochs=2, batch_size=BATCH, shuffle=False, gradient_accumulation_steps=ACCUMULATE,
              gradient_clip_val=CLIP, accelerator="tpu", devices=-1, verbose=0)
    return model


def main(out: Path) -> None:
    model = fit(net())
    torch.save({"net": model.net.state_dict(), "loss": model.history.history["loss"],
                "devices": {p.device.type for p in model.net.parameters()}}, out / "result.pt")
    fit(Broken())


if __name__ == "__main__":
    main(Path(sys.argv[1]))
