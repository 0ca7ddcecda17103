"""Compiled DDP training and the two finders on 2 CPU processes (strategy="ddp": the script runs once per rank).

Usage: python compile_finders.py OUT_DIR
Each rank writes OUT_DIR/rank<R>.pt: eager and compiled weights, find_lr's curve and suggestion, find_batch_size's
answer (each rank's net runs out of memory from its own batch size: rank 0 from 37, rank 1 from 21), and whether
the finders left the weights, the optimizer and the RNG bit for bit as they were.
"""
import copy
import os
import sys

import torch
from torch import nn

import easyfit

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import make_data, make_net

RUN = dict(devices=2, accelerator="cpu", strategy="ddp")
OUT_OF_MEMORY_FROM = {0: 37, 1: 21}


class OutOfMemoryFrom(nn.Module):
    def __init__(self, size: int):
        super().__init__()
        self.size, self.layer = size, nn.Linear(6, 3)

    def forward(self, x):
        if len(x) >= self.size:
            raise torch.OutOfMemoryError(f"CUDA out of memory (simulated for a batch of {len(x)})")
        return self.layer(x)


LINEAR_CALLS = []   # the linear layers in each graph the backend is given


def recording_aot_eager(graph: torch.fx.GraphModule, example_inputs):
    """torch's "aot_eager" backend, counting the net's linear layers in the graphs it compiles."""
    LINEAR_CALLS.append(sum(node.target is torch._C._nn.linear for node in graph.graph.nodes))
    return torch._dynamo.lookup_backend("aot_eager")(graph, example_inputs)


def trained_weights(compile) -> dict:
    net = make_net()
    model = easyfit.Model(net, "cross_entropy", "adam", lr=0.01)
    model.fit(*make_data(), epochs=2, batch_size=24, shuffle=False, verbose=0, compile=compile, **RUN)
    return net.state_dict()


def state(model) -> dict:
    return copy.deepcopy({"net": model.net.state_dict(), "optimizer": model.optimizer.state_dict(),
                          "rng": torch.get_rng_state()})


def main() -> None:
    torch.set_num_threads(1)
    out = sys.argv[1]
    eager, compiled = trained_weights(False), trained_weights({"backend": recording_aot_eager})
    x, y = make_data()
    model = easyfit.Model(make_net(), "cross_entropy", "adam", lr=0.01)
    model.fit(x, y, epochs=1, verbose=0, **RUN)
    before = state(model)
    result = model.find_lr(x, y, num_steps=40, batch_size=16, **RUN)
    after_lr = state(model)
    rank = model.global_rank
    finder = easyfit.Model(OutOfMemoryFrom(OUT_OF_MEMORY_FROM[rank]), "cross_entropy", "sgd")
    batch_size = finder.find_batch_size(x, y, max_batch_size=64, **RUN)
    graphs = dict(torch._dynamo.utils.counters["stats"])
    torch.save({"eager": eager, "compiled": compiled, "graphs": graphs, "linear_calls": sum(LINEAR_CALLS),
                "lrs": result.lrs, "losses": result.losses, "suggestion": result.suggestion, "batch_size": batch_size,
                "before": before, "after_lr": after_lr},
               os.path.join(out, f"rank{rank}.pt"))


if __name__ == "__main__":
    main()
