"""fit / evaluate / predict with `compile=...`: each step compiled once, with static shapes.

The forward and the loss of a batch are compiled together (their backward with them, by AOTAutograd) for the
shapes of the first batch; a batch of other shapes (the short last batch of an epoch) runs eagerly, so nothing
recompiles and no sample is dropped. Padding that batch instead would change what a BatchNorm layer or a
mean-reduced loss computes. The optimizer step is compiled too (a torch.optim optimizer without a loss scaler), with
each group's learning rate held in a tensor, so schedules and warmup change it without recompiling.
"""
from __future__ import annotations

import contextlib
import types
from typing import Any, Callable

import torch
from torch.utils._pytree import tree_leaves

from easyfit.training.loop import call_net

MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
KEYWORDS = ("backend", "mode", "options", "fullgraph", "dynamic")
#: modes whose compiled graphs replay as CUDA graphs: their outputs are overwritten by the next replay
CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")


def compile_settings(value: Any) -> dict | None:
    """fit's `compile` as torch.compile's keyword arguments; None: the step runs eagerly."""
    if value is None or value is False:
        return None
    if value is True:
        return {}
    if isinstance(value, str):
        if value not in MODES:
            raise ValueError(f"compile={value!r} is not a torch.compile mode; pass True, one of "
                             f"{', '.join(map(repr, MODES))}, or a dict of torch.compile options")
        return {"mode": value}
    if isinstance(value, dict):
        unknown = sorted(set(value) - set(KEYWORDS))
        if unknown:
            raise ValueError(f"compile got unknown option(s) {', '.join(map(repr, unknown))}; torch.compile "
                             f"options are {', '.join(KEYWORDS)}")
        return dict(value)
    raise TypeError(f"compile must be True, False, a torch.compile mode or a dict of torch.compile options, got "
                    f"{type(value).__name__}")


def forward_loss(net, loss_fn: Callable | None, inputs, target):
    """(output, loss) of one batch, run eagerly; no loss without `loss_fn` (predict)."""
    output = call_net(net, inputs)
    return output, None if loss_fn is None else loss_fn(output, target)


def _own_cache(function: Callable) -> Callable:
    """A copy of `function` with its own code object: torch.compile keeps its compiled graphs (and counts
    recompilations against its limit) per code object, so each compiled step gets a cache of its own."""
    return types.FunctionType(function.__code__.replace(), function.__globals__, function.__name__,
                              function.__defaults__, function.__closure__)


def _shapes(batch) -> tuple:
    return tuple((tuple(leaf.shape), leaf.dtype, leaf.device) for leaf in tree_leaves(batch)
                 if isinstance(leaf, torch.Tensor))


class CompiledStep:
    """`forward_loss` compiled for the shapes of the first batch it is given; other shapes run eagerly (unless
    the options ask for dynamic shapes). Each call's first batch runs eagerly anyway, with its checks
    (easyfit.training.first_batch)."""

    def __init__(self, settings: dict):
        options = {"dynamic": False, **settings}
        self.static = options["dynamic"] is False
        self.cuda_graphs = options.get("mode") in CUDA_GRAPH_MODES
        self.compiled = torch.compile(_own_cache(forward_loss), **options)
        self.shapes: tuple | None = None

    def __call__(self, net, loss_fn, inputs, target):
        if self.static:
            shapes = _shapes((inputs, target))
            self.shapes = self.shapes or shapes
            if shapes != self.shapes:   # another shape (the short last batch): eagerly, so nothing recompiles
                return forward_loss(net, loss_fn, inputs, target)
        if self.cuda_graphs:
            torch.compiler.cudagraph_mark_step_begin()
        output, loss = self.compiled(net, loss_fn, inputs, target)
        if self.cuda_graphs and loss is not None:   # the epoch's loss tracker keeps it past the next replay, which
            loss = loss.clone()                      # overwrites the graph's outputs; the copy still backpropagates
        return output, loss


class LearningRatesInTensors:
    """Each param group's learning rate as a 0-dim tensor on its parameters' device while the compiled optimizer
    step runs, refreshed from the float the group holds (which schedules, warmup and callbacks set) when it
    changed. A compiled step reads the tensor, so a new rate does not recompile it."""

    def __init__(self, optimizer: torch.optim.Optimizer):
        self.optimizer = optimizer
        self.tensors = [torch.tensor(float(group["lr"]), dtype=torch.float32, device=_device_of(group["params"]))
                        for group in optimizer.param_groups]
        self.values = [float(group["lr"]) for group in optimizer.param_groups]

    def __enter__(self):
        for index, group in enumerate(self.optimizer.param_groups):
            value = float(group["lr"])
            if value != self.values[index]:
                self.tensors[index].fill_(value)
                self.values[index] = value
            group["lr"] = self.tensors[index]

    def __exit__(self, *exc_info):
        for group, value in zip(self.optimizer.param_groups, self.values):
            group["lr"] = value


def _device_of(params: list) -> torch.device:
    return params[0].device if params else torch.device("cpu")


def compiles_optimizer_step(optimizer, precision, strategy) -> bool:
    """Whether the optimizer step is compiled: a torch.optim optimizer (not LBFGS, which needs a closure) stepped
    without a loss scaler by a strategy that leaves the step as the base contract does it. Fused into a few
    kernels, Adam's step is about a tenth of a CPU step of a 784-1024-1024-10 MLP faster than eagerly."""
    from easyfit.distributed.strategies.base import Strategy
    return (type(optimizer).__module__.startswith("torch.optim.") and not isinstance(optimizer, torch.optim.LBFGS)
            and precision.scaler is None and type(strategy).optimizer_step is Strategy.optimizer_step)


class CompiledOptimizerStep:
    """`optimizer.step()` compiled, its learning rates held in tensors."""

    def __init__(self, optimizer: torch.optim.Optimizer, settings: dict):
        options = {key: value for key, value in settings.items() if key != "dynamic"}
        self.optimizer, self.rates = optimizer, LearningRatesInTensors(optimizer)
        self.compiled = torch.compile(_own_cache(_step), **options)

    def __call__(self) -> None:
        with self.rates:
            self.compiled(self.optimizer)
        self.optimizer._opt_called = True   # what an LR scheduler's wrapper of `step` records (it was bypassed)


def _step(optimizer) -> None:
    """The optimizer class's step: an LR scheduler wraps the instance's `step` in code torch.compile skips."""
    type(optimizer).step(optimizer)


class CompiledSteps:
    """A Model's compiled steps, kept between calls so that fitting again (or one epoch per call) compiles
    nothing anew; `settings` is the current call's (None: eager)."""

    def __init__(self):
        self.settings: dict | None = None
        self.cache: dict = {}

    def step(self, role: str):
        """The forward-and-loss callable of `role` for the current call."""
        if self.settings is None:
            return forward_loss
        return self._cached((role, repr(self.settings)), lambda: CompiledStep(self.settings))

    def optimizer_step(self, optimizer, precision, strategy) -> Callable[[], None] | None:
        """The compiled optimizer step for the current call; None: the strategy steps the optimizer."""
        if self.settings is None or not compiles_optimizer_step(optimizer, precision, strategy):
            return None
        key = ("optimizer", id(optimizer), repr(self.settings))
        return self._cached(key, lambda: CompiledOptimizerStep(optimizer, self.settings))

    @contextlib.contextmanager
    def running(self, value: Any, strategy):
        """The settings of a call's `compile` option in force during the call, under the strategy's compile
        context."""
        self.settings = compile_settings(value)
        try:
            with strategy.compile_context() if self.settings is not None else contextlib.nullcontext():
                yield
        finally:
            self.settings = None

    def _cached(self, key, build):
        if key not in self.cache:
            self.cache[key] = build()
        return self.cache[key]

    def __getstate__(self) -> dict:
        """Compiled functions do not pickle: a process that receives the Model compiles its own."""
        return {"settings": self.settings, "cache": {}}


def check_compile(value: Any, strategy, options=None) -> None:
    """Raise before any work when `compile` is malformed, the strategy cannot compile its step, or fit's `options`
    accumulate gradients under CUDA graphs."""
    settings = compile_settings(value)
    if settings is None:
        return
    if not strategy.supports_compile:
        raise ValueError(f"strategy {strategy.name!r} does not support compile={value!r}: its step runs through "
                         "code torch.compile cannot trace as one step. Use compile=False, or strategy='single' / "
                         "'ddp' (see docs/strategies.md, supports_compile).")
    if settings.get("mode") in CUDA_GRAPH_MODES and getattr(options, "gradient_accumulation_steps", 1) > 1:
        raise ValueError(f"compile={value!r} replays CUDA graphs, and each replay overwrites the gradients the "
                         "previous one left, which gradient accumulation keeps across batches; use compile=True "
                         "(or mode 'max-autotune-no-cudagraphs') with gradient_accumulation_steps")
