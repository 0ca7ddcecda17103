"""One short fit per strategy in one launch, recording the names of the attributes each fit assigns on the user's
Model (the one `model.fit` is called on, in this process) from the call's start to its end.

Usage: python model_writes.py OUT_DIR DEVICES STRATEGY [STRATEGY ...]
Each rank writes OUT_DIR/<rank>.pt: {strategy: sorted names assigned}.
"""
import contextlib
import os
import sys

import torch

import easyfit

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import make_data, make_net, make_pipeline_net

NETS = {"pipeline": make_pipeline_net}


@contextlib.contextmanager
def assignments_recorded(model_class):
    """Inside the block, every attribute assigned on a `model_class` instance: yields the set of their names (a
    property's setter is not an attribute: what it assigns is recorded)."""
    names: set = set()
    plain = model_class.__setattr__

    def recorded(model, name, value):
        if not isinstance(getattr(model_class, name, None), property):
            names.add(name)
        plain(model, name, value)
    model_class.__setattr__ = recorded
    try:
        yield names
    finally:
        model_class.__setattr__ = plain


def fit_writes(strategy: str, devices: int) -> list[str]:
    """The names a fit of `strategy` on `devices` assigns on its Model."""
    x, y = make_data()
    model = easyfit.Model(NETS.get(strategy, make_net)(), "cross_entropy", "adam")
    with assignments_recorded(easyfit.Model) as names:
        model.fit(x, y, batch_size=32, epochs=1, verbose=0, devices=devices, accelerator="cpu", strategy=strategy,
                  validation_split=0.25)
    return sorted(names)


def main() -> None:
    out, devices, strategies = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
    torch.set_num_threads(1)
    found = {strategy: fit_writes(strategy, devices) for strategy in strategies}
    torch.save(found, os.path.join(out, f"{int(os.environ.get('RANK', 0))}.pt"))


if __name__ == "__main__":
    main()
