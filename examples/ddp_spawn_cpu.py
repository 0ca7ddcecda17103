"""strategy="ddp_spawn" on 2 CPU processes: the net you pass to the Model comes back trained.

Run:  python examples/ddp_spawn_cpu.py

ddp_spawn starts 2 fresh processes with torch.multiprocessing; each imports this module (so the
`if __name__ == "__main__":` guard is required), receives a pickled copy of the model and the data, and trains
on its half of every global batch. When fit returns, rank 0's trained weights have been copied into the caller's
`net`, and the caller gets rank 0's History: no checkpoint round trip is needed.
"""
from __future__ import annotations

import copy

import torch
from quickstart import load_data
from torch import nn

import easyfit


def main() -> None:
    torch.manual_seed(0)
    x_train, x_test, y_train, y_test = load_data()
    net = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    initial = copy.deepcopy(net.state_dict())
    model = easyfit.Model(net, "cross_entropy", "sgd", metrics=["accuracy"], lr=0.05)

    history = model.fit(x_train, y_train, epochs=10, batch_size=16, verbose=2,
                        devices=2, accelerator="cpu", strategy="ddp_spawn")

    changed = [name for name, value in net.state_dict().items() if not torch.equal(value, initial[name])]
    print(f"fit ran in {history.params['world_size']} spawned processes and returned their History "
          f"({len(history.epoch)} epochs, final loss {history.history['loss'][-1]:.4f})")
    print(f"the caller's net got the trained weights: {len(changed)} of {len(initial)} tensors changed")
    # this evaluate runs here, in the caller, on one process (devices=1), with the weights fit brought back
    scores = model.evaluate(x_test, y_test, verbose=0, devices=1, return_dict=True)
    print(f"test accuracy in the caller: {scores['accuracy']:.4f}")


if __name__ == "__main__":   # required: every spawned process imports this module
    main()
