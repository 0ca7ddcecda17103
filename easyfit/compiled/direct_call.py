"""A whole-step program called straight through its compiled graph once torch.compile's guards pass.

torch.compile's entry (its frame hook and the bytecode that gathers the graph's inputs) costs about 14 µs a call on
a CPU, a fifth of a small net's step. Once a program's first call through torch.compile has traced and compiled
it, each call checks that graph's guards itself (the guard manager torch.compile built for it: module attributes
the forward reads, `training` flags, `requires_grad`, the tensors' shapes, ...) and then calls the compiled graph
directly, its inputs gathered by their names: `l_params_0_` is `params[0]`, `l_state_0_1_2_` is `state[0][1][2]`.
When no graph's guards pass (a callback changed an attribute the forward reads), the call goes through
torch.compile, which compiles a graph for the new values (up to its recompile limit, then it runs the step
eagerly, and torch says so); the new graph is called directly from then on.
A graph with an input of another name (a tensor the net holds besides its parameters and buffers), or with
other outputs than the stacked losses and one tensor per step (the net's outputs, kept for metrics, in step order),
keeps calling through torch.compile.
"""
from __future__ import annotations

from typing import Callable

import torch

from easyfit.utils.torch_internals import FIXED_GLOBALS, GLOBAL_ROOT, GRAPH_INPUT, compiler_for, newest_guards

#: the program's arguments, in order (functional_step.make_program)
ARGUMENTS = ("net", "loss_fn", "params", "buffers", "grads", "state", "inputs", "targets", "weights", "rates")
#: the arguments that hold the program's tensors
TENSOR_ARGUMENTS = ARGUMENTS[2:]


def backend_for(settings: dict) -> Callable:
    """The compiler torch.compile builds from fit's settings (compiling.compile_arguments), as a callable."""
    return compiler_for(settings.get("backend", "inductor"), settings.get("mode"), settings.get("options") or {})


class DirectProgram:
    """`function` compiled with `settings` (torch.compile's arguments), called through torch.compile until a
    graph is compiled and then, where its graph allows it and its guards pass, directly."""

    def __init__(self, function: Callable, settings: dict, outputs: int):
        self.backend, self.outputs = backend_for(settings), outputs   # outputs: the per-step outputs it returns
        self.code = function.__code__
        cells = function.__closure__ or ()   # the guards read the function's free variables as the frame's locals
        self.closure = dict(zip(self.code.co_freevars, (cell.cell_contents for cell in cells)))
        self.direct_calls = 0
        self.direct: list[tuple] = []   # (guard manager, compiled graph, input paths), the newest first
        self.captured: tuple | None = None   # (graph, paths, the traced tensors' ids) of the graph just compiled
        self.compiled = torch.compile(function, backend=self._capture, fullgraph=True, dynamic=False,
                                      options={"guard_filter_fn": guards_to_keep(function)})

    def _capture(self, graph_module: torch.fx.GraphModule, example_inputs: list) -> Callable:
        from easyfit.compiled.eager_random import eager_dropout_masks  # loads inductor's modules: when compiling
        eager_dropout_masks(graph_module)   # traced through torch.func, a Dropout would draw another mask
        compiled = self.backend(graph_module, example_inputs)
        nodes = list(graph_module.graph.nodes)
        outputs = next(node for node in nodes if node.op == "output").args[0]
        matches = [GRAPH_INPUT.fullmatch(node.name) for node in nodes if node.op == "placeholder"]
        if all(matches) and _in_step_order(outputs, nodes, self.outputs):
            paths = [(ARGUMENTS.index(match[1]), [int(i) for i in match[2].split("_")[1:]]) for match in matches]
            self.captured = (compiled, paths, [id(tensor) for tensor in example_inputs])
        return compiled

    def __call__(self, *args):
        if self.direct:
            frame = {**self.closure, **dict(zip(ARGUMENTS, args))}
            for guards, graph, paths in self.direct:
                if guards.check(frame):
                    self.direct_calls += 1
                    result = graph(*_gather(paths, args))
                    return result[0], list(result[1:])
        result = self.compiled(*args)
        if self.captured is not None:   # a graph was compiled: its names must have found the very tensors traced
            graph, paths, example = self.captured
            self.captured = None
            guards = newest_guards(self.code)
            if guards is not None and [id(tensor) for tensor in _gather(paths, args)] == example:
                self.direct.insert(0, (guards, graph, paths))
        return result


def guards_to_keep(function: Callable) -> Callable[[list], list[bool]]:
    """torch.compile's guard filter for a program made by `function`: the guards on what a fit can change (what the
    forward and the loss read from the net and the loss object, the user's globals, grad mode, ...) are kept; those
    on what cannot change during a fit are dropped, since each costs its check on every call:
    - the per-tensor checks on the tensors handed to the program (shapes, strides, `requires_grad` of detached
      copies): the batches' shapes are the program's key (functional_step.ProgramKey), and the parameters,
      gradients, buffers and optimizer state are the fit's own tensors, fixed for its length;
    - torch's own modules and Python's builtins, and the program's own globals and free variables (its key)."""
    fixed_roots = {f"G['{name}']" for name in function.__globals__} | set(function.__code__.co_freevars)

    def keep(entries: list) -> list[bool]:
        return [not _fixed(entry, fixed_roots) for entry in entries]
    return keep


def _fixed(entry, fixed_roots: set) -> bool:
    name = entry.name
    if entry.guard_type in ("TENSOR_MATCH", "NO_TENSOR_ALIASING") and name.split("[")[0] in TENSOR_ARGUMENTS:
        return True
    root = GLOBAL_ROOT.match(name)
    return name.startswith(FIXED_GLOBALS) or (root[0] if root else name.split("[")[0].split(".")[0]) in fixed_roots


def _gather(paths: list, args: tuple) -> list:
    flat = []
    for position, indices in paths:
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
