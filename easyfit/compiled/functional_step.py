"""One compiled program for a run of training steps: forward, loss, backward, clipping and the optimizer update of
one or N batches, traced by torch.compile(fullgraph=True) into a single graph.

The gradients come from `torch.func.grad_and_value` over `torch.func.functional_call`, the update from torch.optim's
own functional SGD / Adam / AdamW, so the numbers are the eager step's. The program writes the gradients into each
parameter's `.grad` (added to it inside an accumulation window) and updates parameters and optimizer state in place:
fixed input buffers mutated in place, which is what a CUDA graph ("reduce-overhead") captures and replays.

Which program a call needs (the steps' accumulation pattern, the batch shapes, the optimizer's settings) is this
module's `ProgramKey`, looked up once per call; within a program, torch.compile's guards (checked by
easyfit.compiled.direct_call) catch what a callback changed between calls, and each program has a code object of its
own (see `own_cache`), so its recompilations count against its own limit.
"""
from __future__ import annotations

import types
from dataclasses import dataclass
from typing import Callable

import torch
from torch.func import functional_call, grad_and_value
from torch.optim.adam import adam
from torch.optim.sgd import sgd
from torch.utils._pytree import tree_leaves

#: the optimizer classes whose update runs inside the program, and the group settings it reads
GROUP_SETTINGS: dict[type, tuple[str, ...]] = {
    torch.optim.SGD: ("weight_decay", "momentum", "dampening", "nesterov", "maximize"),
    torch.optim.Adam: ("amsgrad", "betas", "weight_decay", "eps", "maximize", "decoupled_weight_decay"),
    torch.optim.AdamW: ("amsgrad", "betas", "weight_decay", "eps", "maximize", "decoupled_weight_decay"),
}
SGD_STATE, ADAM_STATE = ("momentum_buffer",), ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "step")


def unfusable_reason(net: torch.nn.Module, optimizer, scaled: bool, strategy) -> str | None:
    """Why the step cannot be one program here (None: it can): the strategy's step must be the base contract's on one
    process, the update one this module traces, without a loss scaler, over the net's own parameters."""
    from easyfit.distributed.strategies.base import Strategy
    kind = type(strategy)
    if strategy.world_size > 1:
        return (f"strategy {strategy.name!r} trains on {strategy.world_size} processes, whose gradients are combined "
                "between the backward and the update")
    if any(getattr(kind, name) is not getattr(Strategy, name) for name in (
            "training_step", "backward", "optimizer_step", "zero_grad", "clip_gradients", "no_sync")):
        return f"strategy {strategy.name!r} runs its own step (the forward, backward and update stay separate calls)"
    if type(optimizer) not in GROUP_SETTINGS:
        return (f"the update of {type(optimizer).__name__} is not traced into the step (SGD, Adam and AdamW are); "
                "the optimizer step is compiled on its own")
    if scaled:
        return "precision '16-mixed' scales the loss, and its step is skipped on overflow: a separate call"
    if any(group.get("differentiable") for group in optimizer.param_groups):
        return "an optimizer with differentiable=True is stepped eagerly"
    names = {id(p) for p in net.parameters()}
    if any(id(p) not in names for group in optimizer.param_groups for p in group["params"]):
        return "the optimizer holds tensors that are not the net's parameters"
    return None


def capturable(optimizer) -> list | None:
    """Adam's step counters on its parameters' device (torch keeps them on the host unless `capturable`), so that the
    whole program runs on the device: what a CUDA graph captures. Nothing to do on a CPU or for SGD. The groups'
    `capturable` flags before, for `uncapturable`."""
    if type(optimizer) is torch.optim.SGD:
        return None
    before = [group.get("capturable") for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        device = group["params"][0].device if group["params"] else torch.device("cpu")
        if device.type == "cpu":
            continue
        group["capturable"] = True   # eager steps then keep the counters where they are
        for p in group["params"]:
            state = optimizer.state.get(p, {})
            if "step" in state:
                state["step"] = state["step"].to(device)
    return before


def uncapturable(optimizer, before: list | None) -> None:
    """The optimizer as it was before `capturable`: an eager step of a capturable Adam computes its bias corrections
    on the device, a few more kernels per parameter (a GPT-2 step's AdamW took 6.1 ms of GPU time against 4.0)."""
    for group, flag in zip(optimizer.param_groups, before or ()):
        if group.get("capturable") == flag:
            continue
        group["capturable"] = flag
        for p in group["params"]:
            state = optimizer.state.get(p, {})
            if "step" in state and not group.get("fused"):
                state["step"] = state["step"].cpu()


def leave_graph_pool(params: list[torch.Tensor]) -> None:
    """Drops the gradients at the start of an accumulation window, whose first step overwrites them anyway. A step
    compiled in parts under CUDA graphs (the fit's first) leaves them in the graphs' memory pool, which a later
    replay overwrites. The optimizer's state was made by the eager optimizer step, outside the pool."""
    for p in params:
        p.grad = None


def state_ready(optimizer) -> bool:
    """Whether each parameter has the state the program reads (the first step, run eagerly, makes it): a
    parameter that got no gradient then keeps none, and the eager step would skip it."""
    for group in optimizer.param_groups:
        needs = ADAM_STATE[:2] if type(optimizer) is not torch.optim.SGD else \
            (SGD_STATE if group["momentum"] else ())
        for p in group["params"]:
            if p.grad is None and not optimizer.state.get(p) or any(k not in optimizer.state.get(p, {}) for k in needs):
                return False
    return True


@dataclass(frozen=True)
class ProgramKey:
    """What a program was traced for, besides its tensors' values: compared on every call instead of guards."""
    steps: tuple[tuple[bool, bool], ...]   # per step: (a new accumulation window, the window's last batch)
    shapes: tuple                           # each batch's tensors: shape, dtype, device
    settings: tuple                         # the optimizer's group settings and parameter counts
    divisor: int
    clip: float | None
    autocast: torch.dtype | None
    weighted: bool
    outputs: bool                           # return the outputs (for metrics)
    trainable: tuple[bool, ...]             # per parameter: requires_grad (a frozen one gets no gradient, no update)


def own_cache(function: Callable) -> Callable:
    """A copy of `function` with its own code object: torch.compile keeps its compiled graphs (and counts
    recompilations against its limit) per code object, so each compiled step gets a cache of its own."""
    return types.FunctionType(function.__code__.replace(), function.__globals__, function.__name__,
                              function.__defaults__, function.__closure__)


def optimizer_settings(optimizer) -> tuple:
    """Each group's settings the update reads, and its parameter count: part of a program's key."""
    names = GROUP_SETTINGS[type(optimizer)]
    return tuple((tuple(group.get(name, False) for name in names), len(group["params"]))
                 for group in optimizer.param_groups)


def shapes_of(*trees) -> tuple:
    """Each tensor's shape, dtype and device (a batch of plain tensors without a walk through its structure)."""
    if all(tree is None or type(tree) is torch.Tensor for tree in trees):
        return tuple(tree if tree is None else (tree.shape, tree.dtype, tree.device) for tree in trees)
    return tuple((tuple(leaf.shape), leaf.dtype, leaf.device) for leaf in tree_leaves(trees)
                 if isinstance(leaf, torch.Tensor))


def state_tensors(optimizer) -> list[list]:
    """Each group's optimizer state as the functional update takes it (lists of tensors, None where absent)."""
    names = SGD_STATE if type(optimizer) is torch.optim.SGD else ADAM_STATE
    return [[[optimizer.state.get(p, {}).get(name) for p in group["params"]] for name in names]
            for group in optimizer.param_groups]


def _update(kind: type, settings: tuple, params, grads, state, lr) -> None:
    """One group's optimizer update, in place, by torch.optim's functional form of `kind`."""
    values = dict(zip(GROUP_SETTINGS[kind], settings))
    if kind is torch.optim.SGD:
        sgd(params, grads, state[0], foreach=False, lr=lr, **values)
        return
    beta1, beta2 = values.pop("betas")
    exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps = state
    adam(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs if values["amsgrad"] else [], steps, foreach=False,
         capturable=params[0].device.type != "cpu", beta1=beta1, beta2=beta2, lr=lr, **values)


def clip_(grads: list[torch.Tensor], max_norm: float) -> None:
    """torch.nn.utils.clip_grad_norm_ on the gradients, in place."""
    total = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
    coefficient = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in grads:
        g.mul_(coefficient.to(g.dtype))


def make_program(key: ProgramKey, kind: type, names: list[str], buffer_names: list[str]) -> Callable:
    """The Python function a program traces: `key.steps` steps over per-step lists of inputs, targets and sample
    weights; `names` are the optimized parameters' names in the net, `buffer_names` its buffers'. A frozen parameter
    (`key.trainable`) enters the forward as a constant, and gets no gradient and no update, as eagerly."""
    trained = [index for index, trainable in enumerate(key.trainable) if trainable]

    def steps(net, loss_fn, params, buffers, grads, state, inputs, targets, weights, rates):
        losses, outputs = [], []
        for k, (fresh, last) in enumerate(key.steps):
            def loss_of(values, buffers, k=k):   # the buffers are arguments: a BatchNorm updates them in place
                current = [p.detach() for p in params]
                for index, value in zip(trained, values):
                    current[index] = value
                tensors = {**dict(zip(names, current)), **dict(zip(buffer_names, buffers))}
                with torch.autocast(params[0].device.type, dtype=key.autocast, enabled=key.autocast is not None):
                    output = _call(net, tensors, inputs[k])
                    loss = loss_fn.weighted(output, targets[k], weights[k]) if key.weighted else \
                        loss_fn(output, targets[k])
                return (loss / key.divisor if key.divisor > 1 else loss), (output, loss)
            new, (_, (output, loss)) = grad_and_value(loss_of, has_aux=True)(
                [params[index].detach() for index in trained], buffers)
            losses.append(loss.detach())
            if key.outputs:
                outputs.append(output)
            with torch.no_grad():
                for index, value in zip(trained, new):
                    grads[index].copy_(value) if fresh else grads[index].add_(value)
                if last:
                    _clip_and_update(key, kind, params, grads, state, rates[k])
        return torch.stack(losses), outputs
    return steps


def _clip_and_update(key: ProgramKey, kind: type, params, grads, state, rates) -> None:
    """Clip the trained parameters' gradients, then update each group's trained parameters."""
    if key.clip is not None:
        clip_([g for g, trainable in zip(grads, key.trainable) if trainable], key.clip)
    start = 0
    for index, (settings, count) in enumerate(key.settings):
        end = start + count
        mask = key.trainable[start:end]
        if any(mask):
            def kept(values, mask=mask):
                return [value for value, trainable in zip(values, mask) if trainable]
            _update(kind, settings, kept(params[start:end]), kept(grads[start:end]),
                    [kept(values) for values in state[index]], rates[index])
        start = end


def _call(net: torch.nn.Module, values: dict, inputs):
    """The net's output with `values` as its parameters, the inputs passed as the loop passes them (call_net)."""
    if isinstance(inputs, tuple):
        return functional_call(net, values, inputs)
    if isinstance(inputs, dict):
        return functional_call(net, values, (), inputs)
    return functional_call(net, values, (inputs,))


class ParameterNames:
    """The optimizer's parameters (in group order) and the net's buffers, with their names, for functional_call."""

    def __init__(self, net: torch.nn.Module, optimizer):
        by_id = {id(p): name for name, p in net.named_parameters(remove_duplicate=False)}
        self.params = [p for group in optimizer.param_groups for p in group["params"]]
        self.names = [by_id[id(p)] for p in self.params]
        named = list(net.named_buffers())
        self.buffer_names, self.buffers = [name for name, _ in named], [buffer for _, buffer in named]


def ensure_grads(params: list[torch.Tensor]) -> list[torch.Tensor | None]:
    """Each trainable parameter's `.grad`, a zero buffer where it has none (the program overwrites or adds to it);
    a frozen parameter has none, as after an eager step."""
    for p in params:
        if not p.requires_grad:
            p.grad = None
        elif p.grad is None:
            p.grad = torch.zeros_like(p)
    return [p.grad for p in params]
