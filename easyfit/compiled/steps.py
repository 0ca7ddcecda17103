"""fit / evaluate / predict with `compile=...`: each step compiled once, with the sizes that change dynamic.

Where it can (one process, SGD / Adam / AdamW, no loss scaler), fit runs each training step, or N of them
(`steps_per_execution`), as one program: easyfit.compiled.functional_step and multi_step. Elsewhere the forward
and the loss of a batch are compiled together (their backward with them, by AOTAutograd) for the shapes of the
first batch, with the dimensions seen to change between batches dynamic (easyfit.compiled.shape_family); a batch
that differs in its batch size only (the short last batch of an epoch) runs eagerly, so nothing recompiles and no
sample is dropped. Padding that batch instead would change what a BatchNorm layer or a
mean-reduced loss computes. The optimizer step is compiled too (a torch.optim optimizer without a loss scaler), with
each group's learning rate held in a tensor, so schedules and warmup change it without recompiling.

A `logging.Logger` call in the forward or the loss (a library's `logger.warning_once`, say) would split the step:
torch.compile stops its graph at each one. Under `compile=` such calls are left out of the compiled graphs: they run
in the fit's eager first step, not in the compiled steps after it.
"""
from __future__ import annotations

import contextlib
import logging
import types
from typing import Any, Callable

import torch
from torch.utils._pytree import tree_map

from easyfit.compiled.functional_step import own_cache, shapes_of
from easyfit.compiled.multi_step import FusedTraining, whole_step_runner
from easyfit.compiled.settings import compile_arguments, replays_cuda_graphs
from easyfit.compiled.shape_family import ShapeFamily
from easyfit.data.contents import forward_loss
from easyfit.distributed.strategies.base import unwrap
from easyfit.utils import torch_internals
from easyfit.utils.torch_internals import compile_totals, internals_tested, notice_untested, untested_reason


class CompiledStep:
    """`forward_loss` compiled for the shapes of the first batch it is given, with the dimensions seen to change
    dynamic (easyfit.compiled.shape_family); a batch that differs in its batch size only (a short last batch) runs
    eagerly, unless the options ask for dynamic shapes. Each call's first batch runs eagerly anyway, with its checks
    (easyfit.training.first_batch). On a torch release easyfit has not tested, each set of trainable parameters gets
    a compiled function of its own: torch 2.9 reused a graph traced with a layer frozen, with dynamic sizes, after
    the layer was unfrozen (the layer then learned nothing)."""

    def __init__(self, settings: dict):
        options = compile_arguments({"dynamic": False, **settings}, {})
        self.static = options["dynamic"] is False
        self.cuda_graphs = replays_cuda_graphs(settings)
        self.per_trainable: dict | None = None if internals_tested() else {}   # {trainable flags: compiled}
        self.compiled = torch.compile(own_cache(forward_loss), **options)
        self.options = options
        self.family: ShapeFamily | None = None
        self.net_forward: tuple[torch.nn.Module, Callable] | None = None   # (a wrapped net, its compiled forward)

    def __call__(self, net, loss_fn, inputs, target):
        if self.static:
            shapes = shapes_of(inputs, target)
            self.family = self.family or ShapeFamily(shapes)
            if not self.family.takes(shapes, None):   # a short last batch: eagerly, so nothing recompiles
                return forward_loss(net, loss_fn, inputs, target)
            self.family.mark(inputs, target)
        if self.cuda_graphs:
            torch.compiler.cudagraph_mark_step_begin()
        with self._wrapped_net_compiled(net):
            output, loss = self._compiled_for(net)(net, loss_fn, inputs, target)
        if self.cuda_graphs:   # the next replay overwrites the graph's outputs, which the epoch's loss tracker and
            # predict keep past it; the loss's copy still backpropagates
            output = tree_map(lambda value: value.clone() if isinstance(value, torch.Tensor) else value, output)
            loss = None if loss is None else loss.clone()
        return output, loss

    def _compiled_for(self, net) -> Callable:
        if self.per_trainable is None:
            return self.compiled
        trainable = tuple(param.requires_grad for param in net.parameters())
        if trainable not in self.per_trainable:
            self.per_trainable[trainable] = (self.compiled if not self.per_trainable else
                                             torch.compile(own_cache(forward_loss), **self.options))
        return self.per_trainable[trainable]

    @contextlib.contextmanager
    def _wrapped_net_compiled(self, net):
        """The user's net inside a DDP wrapper compiled on its own during the call: DDP's forward breaks the traced
        graph before it calls the net, and torch.compile starts no trace in a torch.nn module's own forward, so a
        net such as an nn.Sequential would otherwise run eagerly."""
        inner = unwrap(net)
        if inner is net or "forward" in vars(inner):
            yield
            return
        if self.net_forward is None or self.net_forward[0] is not inner:
            options, inductor = self.options, self.options.get("options") or {}
            if inductor.get("triton.cudagraphs"):   # DDP's gradient hooks run amid the net's backward
                options = {**options, "options": {**inductor, "triton.cudagraphs": False}}
            compiled = torch.compile(own_cache(type(inner).forward), **options)
            self.net_forward = (inner, types.MethodType(compiled, inner))
        inner.forward = self.net_forward[1]
        try:
            yield
        finally:
            del inner.forward


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
    without a loss scaler by a strategy whose step is the plain one (`plain_optimizer_step`). Fused into a few
    kernels, Adam's step is about a tenth of a CPU step of a 784-1024-1024-10 MLP faster than eagerly."""
    return (type(optimizer).__module__.startswith("torch.optim.") and not isinstance(optimizer, torch.optim.LBFGS)
            and precision.scaler is None and strategy.capabilities.plain_optimizer_step)


class CompiledOptimizerStep:
    """`optimizer.step()` compiled, its learning rates held in tensors."""

    def __init__(self, optimizer: torch.optim.Optimizer, settings: dict):
        options = compile_arguments({key: value for key, value in settings.items() if key != "dynamic"}, {})
        self.optimizer, self.rates = optimizer, LearningRatesInTensors(optimizer)
        self.compiled = torch.compile(own_cache(_step), **options)

    def __call__(self) -> None:
        with self.rates:
            self.compiled(self.optimizer)
        self.optimizer._opt_called = True   # what an LR scheduler's wrapper of `step` records (it was bypassed)


def _step(optimizer) -> None:
    """The optimizer class's step: an LR scheduler wraps the instance's `step` in code torch.compile skips."""
    type(optimizer).step(optimizer)


class CompiledSteps:
    """A call's compiled steps under `settings` (`check_compile`'s), kept in the Model's `cache` between calls so that
    fitting again (or one epoch per call) compiles nothing anew; `declined` holds the reasons a fit's step could not
    be one program, each said once."""

    def __init__(self, settings: dict, cache: dict, declined: set):
        self.settings, self.cache, self.declined = settings, cache, declined

    def step(self, role: str):
        """The compiled forward-and-loss callable of `role`."""
        return self._cached((role, repr(self.settings)), lambda: CompiledStep(self.settings))

    def optimizer_step(self, optimizer, precision, strategy) -> Callable[[], None] | None:
        """The compiled optimizer step; None: the strategy steps the optimizer."""
        if not compiles_optimizer_step(optimizer, precision, strategy):
            return None
        key = ("optimizer", id(optimizer), repr(self.settings))
        return self._cached(key, lambda: CompiledOptimizerStep(optimizer, self.settings))

    def runner(self, loop) -> FusedTraining | None:
        """The runner of whole-step programs for a fit's Loop (easyfit.compiled.multi_step); None: the loop's step
        calls the compiled parts."""
        return whole_step_runner(loop, self.settings, self._cached, self.declined)

    @contextlib.contextmanager
    def running(self, strategy, say: Callable[[str], Any] | None = None):
        """The call under the strategy's compile context; `say` (print, say) gets a line on what the call compiled
        and how long that took."""
        if not internals_tested():
            notice_untested()   # once per process, for the runner's reason too
            self.declined.add(untested_reason())
        before = compile_totals() if say is not None and internals_tested() else None
        with _compiling(strategy):
            yield
        if before is not None:
            graphs, seconds = (now - then for now, then in zip(compile_totals(), before))
            programs = sum(len(value) for value in self.cache.values() if isinstance(value, dict))
            say(f"compile=: {graphs} graph{'s' * (graphs != 1)} compiled in {seconds:.1f} s; {programs} "
                f"whole-step training program{'s' * (programs != 1)}")

    def _cached(self, key, build):
        if key not in self.cache:
            self.cache[key] = build()
        return self.cache[key]


@contextlib.contextmanager
def _compiling(strategy):
    """What a call with `compile=` runs under: the strategy's compile context, logging calls left out of the graphs."""
    with strategy.compile_context(), logging_left_out():
        yield


def logging_left_out():
    """torch.compile's setting under which the methods of every `logging.Logger` (those a library adds too, such as
    `warning_once`) are left out of a traced graph instead of splitting it there."""
    return torch_internals.logging_left_out(
        {value for value in vars(logging.Logger).values()
         if callable(value) and getattr(value, "__name__", "").split("_")[0] in LOGGING_METHODS})


#: the `logging.Logger` methods (and those whose name starts with one, such as `warning_once`) that log a message
LOGGING_METHODS = ("debug", "info", "warning", "warn", "error", "exception", "critical", "fatal", "log")
