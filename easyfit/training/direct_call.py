"""A whole-step program called straight through its compiled graph after its first call.

torch.compile's entry (its frame hook and the bytecode that gathers the graph's inputs) costs about 14 µs a call on
a CPU, a fifth of a small net's step. A program's guards are dropped anyway (functional_step.ProgramKey stands for
them), so once its first call through torch.compile has traced and compiled it, the compiled graph is called
directly, its inputs gathered by their names: `l_params_0_` is `params[0]`, `l_state_0_1_2_` is `state[0][1][2]`.
A graph with an input of another name (a tensor the net holds besides its parameters and buffers), or with
other outputs than the stacked losses and one tensor per step (the net's outputs, kept for metrics, in step order),
keeps calling through torch.compile.
"""
from __future__ import annotations

import re
from typing import Callable

import torch

#: the program's arguments, in order (functional_step.make_program)
ARGUMENTS = ("net", "loss_fn", "params", "buffers", "grads", "state", "inputs", "targets", "weights", "rates")
PLACEHOLDER = re.compile(r"l_(params|buffers|grads|state|inputs|targets|weights|rates)((?:_\d+)*)_")


def backend_for(settings: dict) -> Callable:
    """The compiler torch.compile builds from fit's settings (compiling.compile_arguments), as a callable."""
    options = {key: value for key, value in (settings.get("options") or {}).items() if key != "guard_filter_fn"}
    backend = settings.get("backend", "inductor")
    if backend == "inductor":
        return torch._TorchCompileInductorWrapper(None, options, False)
    return torch._TorchCompileWrapper(backend, settings.get("mode"), options or None, False)


class DirectProgram:
    """`function` compiled with `settings` (torch.compile's arguments), called through torch.compile once and then,
    where its graph allows it, directly."""

    def __init__(self, function: Callable, settings: dict, outputs: int):
        self.backend, self.outputs = backend_for(settings), outputs   # outputs: the per-step outputs it returns
        self.graph = self.paths = self.example = None
        options = {"guard_filter_fn": (settings.get("options") or {}).get("guard_filter_fn")}
        self.compiled = torch.compile(function, backend=self._capture, fullgraph=True, dynamic=False,
                                      options=options if options["guard_filter_fn"] else None)

    def _capture(self, graph_module: torch.fx.GraphModule, example_inputs: list) -> Callable:
        compiled = self.backend(graph_module, example_inputs)
        nodes = list(graph_module.graph.nodes)
        outputs = next(node for node in nodes if node.op == "output").args[0]
        matches = [PLACEHOLDER.fullmatch(node.name) for node in nodes if node.op == "placeholder"]
        if all(matches) and _in_step_order(outputs, nodes, self.outputs):
            self.paths = [(ARGUMENTS.index(match[1]), [int(i) for i in match[2].split("_")[1:]]) for match in matches]
            self.graph, self.example = compiled, [id(tensor) for tensor in example_inputs]
        return compiled

    def __call__(self, *args):
        if self.graph is not None and self.example is None:
            result = self.graph(*self._gather(args))
            return result[0], list(result[1:])
        result = self.compiled(*args)
        if self.example is not None:   # the first call: the names must have found the very tensors traced
            if [id(tensor) for tensor in self._gather(args)] != self.example:
                self.graph = None
            self.example = None
        return result

    def _gather(self, args: tuple) -> list:
        flat = []
        for position, indices in self.paths:
            value = args[position]
            for index in indices:
                value = value[index]
            flat.append(value)
        return flat


def _in_step_order(outputs, nodes: list, count: int) -> bool:
    """Whether the graph returns the stacked losses and then `count` tensors made in order (one per step)."""
    if not isinstance(outputs, (tuple, list)) or len(outputs) != 1 + count:
        return False
    if not all(isinstance(node, torch.fx.Node) and node.op == "call_function" for node in outputs):
        return False
    positions = [nodes.index(node) for node in outputs[1:]]
    return outputs[0].target is torch.stack and positions == sorted(set(positions))
