"""fit / evaluate / predict with `compile=...`: each step compiled once, with the sizes that change dynamic.

Where it can (one process, SGD / Adam / AdamW, no loss scaler), fit runs each training step, or N of them
(`steps_per_execution`), as one program: easyfit.training.functional_step and multi_step. Elsewhere the forward
and the loss of a batch are compiled together (their backward with them, by AOTAutograd) for the shapes of the
first batch, with the dimensions seen to change between batches dynamic (easyfit.training.shape_family); a batch
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
import warnings
from typing import Any, Callable

import torch
from torch.utils._pytree import tree_map

from easyfit.distributed.strategies.base import unwrap
from easyfit.training.direct_call import DirectProgram
from easyfit.training.fit_options import FitOptions
from easyfit.training.functional_step import ParameterNames, make_program, own_cache, shapes_of, unfusable_reason
from easyfit.training.loop import call_net
from easyfit.training.multi_step import FusedTraining, check_steps_per_execution, small_step, steps_per_call
from easyfit.training.shape_family import ShapeFamily
from easyfit.utils import torch_internals
from easyfit.utils.torch_internals import (
    compile_totals,
    internals_tested,
    mode_names,
    mode_options,
    notice_untested,
    untested_reason,
)

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
        check_mode(value)
        return {"mode": value}
    if isinstance(value, dict):
        unknown = sorted(set(value) - set(KEYWORDS))
        if unknown:
            raise ValueError(f"compile got unknown option(s) {', '.join(map(repr, unknown))}; torch.compile "
                             f"options are {', '.join(KEYWORDS)}")
        if value.get("mode") is not None:
            check_mode(value["mode"])
            if value.get("options") and value.get("backend", "inductor") != "inductor":
                raise ValueError(f"compile={value!r} gives both a mode and options, which torch.compile takes for "
                                 "its inductor backend only; drop one of them")
        return dict(value)
    raise TypeError(f"compile must be True, False, a torch.compile mode or a dict of torch.compile options, got "
                    f"{type(value).__name__}")


def check_mode(mode: str) -> None:
    """Raises unless `mode` is one of the modes the running torch's inductor lists."""
    modes = mode_names()
    if mode not in modes:
        raise ValueError(f"compile={mode!r} is not a torch.compile mode of torch {torch.__version__}; pass True, "
                         f"one of {', '.join(map(repr, modes))}, or a dict of torch.compile options")


def forward_loss(net, loss_fn: Callable | None, inputs, target):
    """(output, loss) of one batch, run eagerly; no loss without `loss_fn` (predict)."""
    output = call_net(net, inputs)
    return output, None if loss_fn is None else loss_fn(output, target)


def compile_arguments(settings: dict, extra: dict) -> dict:
    """torch.compile's keyword arguments from fit's settings, with `extra` inductor options. With inductor a mode is
    given as the options it stands for (torch.compile takes a mode or options, not both), and random layers draw
    eager's numbers (`fallback_random`), so Dropout trains as it does eagerly; on a tested torch each mask is one
    eager call (easyfit.training.eager_random) and CPU matrix products go to oneDNN where it is faster here
    (easyfit.training.onednn_matmul). Other backends get the mode or the options as given."""
    arguments = {key: value for key, value in settings.items() if key not in ("mode", "options")}
    given = settings.get("options") or {}
    if settings.get("backend", "inductor") != "inductor":
        if settings.get("mode") is not None:
            arguments["mode"] = settings["mode"]
        if given:
            arguments["options"] = dict(given)
        return arguments
    options = {**mode_options(settings.get("mode")), "fallback_random": True}
    if internals_tested():
        from easyfit.training import onednn_matmul
        from easyfit.training.eager_random import EagerMasks
        options.update({"post_grad_custom_pre_pass": EagerMasks(), **extra})
        if onednn_matmul.available():
            options["post_grad_custom_post_pass"] = onednn_matmul.OneDnnMatmuls()
    return {**arguments, "options": {**options, **given}}


class CompiledStep:
    """`forward_loss` compiled for the shapes of the first batch it is given, with the dimensions seen to change
    dynamic (easyfit.training.shape_family); a batch that differs in its batch size only (a short last batch) runs
    eagerly, unless the options ask for dynamic shapes. Each call's first batch runs eagerly anyway, with its checks
    (easyfit.training.first_batch). On a torch release easyfit has not tested, each set of trainable parameters gets
    a compiled function of its own: torch 2.9 reused a graph traced with a layer frozen, with dynamic sizes, after
    the layer was unfrozen (the layer then learned nothing)."""

    def __init__(self, settings: dict):
        options = compile_arguments({"dynamic": False, **settings}, {})
        self.static = options["dynamic"] is False
        self.cuda_graphs = settings.get("mode") in CUDA_GRAPH_MODES
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
            and precision.scaler is None and strategy.plain_optimizer_step)


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
    """A Model's compiled steps, kept between calls so that fitting again (or one epoch per call) compiles
    nothing anew; `settings` is the current call's (None: eager)."""

    def __init__(self):
        self.settings: dict | None = None
        self.cache: dict = {}
        self.declined: set = set()   # the reasons a fit's step could not be one program, each said once

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

    def fused(self, loop) -> FusedTraining | None:
        """The runner of whole-step programs for a fit's Loop; None: the steps run as separate calls (eagerly, or
        compiled per part), which an explicit steps_per_execution > 1 refuses."""
        if self.settings is None:
            return None
        value = loop.settings.steps_per_execution
        reason = whole_step_refusal(loop.net, loop.optimizer, loop.precision.scaler is not None, loop.strategy)
        if reason is None and loop.items is not None:   # the one reason that depends on the data (its targets)
            reason = "the loss averages over counted items (tokens), whose number divides each step"
        if reason is not None:
            if value not in ("auto", 1):
                raise steps_need_one_program(value, reason)
            if reason not in self.declined:
                self.declined.add(reason)
                warnings.warn(f"compile=: {reason}; the forward with the loss and the optimizer step are compiled "
                              "as separate calls, not as one program", stacklevel=2)
            return None
        settings = self.settings
        steps = steps_per_call(value, loop.callbacks, loop.net, loop.settings.batch_size,
                               loop.settings.gradient_accumulation_steps)
        loss = getattr(loop.loss_fn, "loss_fn", loop.loss_fn)   # a fit with weights wraps the Model's loss anew
        # the programs depend on the optimizer's class, the order of its parameters and their shapes, not on the
        # object: a new optimizer of the same kind over the same net (compile() before fitting again) reuses them
        names = ParameterNames(loop.net, loop.optimizer)
        programs = self._cached(("programs", id(loop.net), type(loop.optimizer), tuple(names.names),
                                 shapes_of(names.params, names.buffers), id(loss), repr(settings),
                                 loop.settings.step_key()), dict)
        device = loop.strategy.root_device
        extra = {}
        if device.type == "cpu" and small_step(loop.net, loop.settings.batch_size) and \
                not mode_options(settings.get("mode")).get("fallback_by_default"):
            # the kernels called from C++, not from Python: less per call, but slower matrix products, so only where
            # calls cost more than arithmetic (the figures: docs/performance.md, "The whole step as one program");
            # not where a mode leaves most operations to torch's eager kernels ("lite"), which the C++ wrapper's
            # calls into them fail on (torch 2.15: pow with a number first)
            extra["cpp_wrapper"] = True
        arguments = compile_arguments({**settings, "fullgraph": True, "dynamic": False}, extra)

        def build(key, kind, names):
            return DirectProgram(own_cache(make_program(key, kind, names.names, names.buffer_names)), arguments,
                                 len(key.steps) if key.outputs else 0)
        runner = FusedTraining(loop, steps, build, programs, names)
        runner.cuda_graphs = settings.get("mode") in CUDA_GRAPH_MODES
        return runner

    @contextlib.contextmanager
    def running(self, settings: dict | None, strategy, say: Callable[[str], Any] | None = None):
        """The settings of a call's `compile` option (`check_compile`'s) in force during the call, under the
        strategy's compile context; `say` (print, say) gets a line on what the call compiled and how long that
        took."""
        self.settings = settings
        if self.settings is not None and not internals_tested():
            notice_untested()   # once per process, for `fused`'s reason too
            self.declined.add(untested_reason())
        before = compile_totals() if self.settings is not None and say is not None and internals_tested() else None
        try:
            with _compiling(strategy) if self.settings is not None else contextlib.nullcontext():
                yield
            if before is not None:
                graphs, seconds = (now - then for now, then in zip(compile_totals(), before))
                programs = sum(len(value) for value in self.cache.values() if isinstance(value, dict))
                say(f"compile=: {graphs} graph{'s' * (graphs != 1)} compiled in {seconds:.1f} s; {programs} "
                    f"whole-step training program{'s' * (programs != 1)}")
        finally:
            self.settings = None

    def _cached(self, key, build):
        if key not in self.cache:
            self.cache[key] = build()
        return self.cache[key]

    def __getstate__(self) -> dict:
        """Compiled functions do not pickle: a process that receives the Model compiles its own."""
        return {"settings": self.settings, "cache": {}, "declined": set()}


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


def check_compile(value: Any, strategy, options=None, model=None, precision: str = "32") -> dict | None:
    """`compile` as torch.compile's settings (None: eager); raises before any work when it is malformed, the
    strategy cannot compile its step, fit's `options` accumulate gradients under CUDA graphs, or ask for several
    steps per program where `model`'s step cannot be one (`whole_step_refusal`: all but counted items, which
    depend on the data, are known here)."""
    settings = compile_settings(value)
    if not isinstance(options, FitOptions):   # evaluate, predict, the finders: fit's defaults
        options = FitOptions()
    steps = options.steps_per_execution
    check_steps_per_execution(steps, settings is not None, options.callbacks or ())
    if settings is None:
        return None
    if model is not None and steps not in ("auto", 1):
        reason = whole_step_refusal(model.net, model.optimizer, precision == "16-mixed", strategy)
        if reason is not None:
            raise steps_need_one_program(steps, reason)
    if not strategy.supports_compile:
        raise ValueError(f"strategy {strategy.name!r} does not support compile={value!r}: its step runs through "
                         "code torch.compile cannot trace as one step. Use compile=False, or strategy='single' / "
                         "'ddp' (see docs/strategies.md, supports_compile).")
    if settings.get("mode") in CUDA_GRAPH_MODES and options.gradient_accumulation_steps > 1:
        raise ValueError(f"compile={value!r} replays CUDA graphs, and each replay overwrites the gradients the "
                         "previous one left, which gradient accumulation keeps across batches; use compile=True "
                         "(or mode 'max-autotune-no-cudagraphs') with gradient_accumulation_steps")
    return settings


def whole_step_refusal(net, optimizer, scaled: bool, strategy) -> str | None:
    """Why a training step cannot be one compiled program here, the data aside (None: it can): first a reason that
    holds on any torch, then the fallback's."""
    reason = unfusable_reason(net, optimizer, scaled, strategy)
    return reason if reason is not None or internals_tested() else untested_reason()


def steps_need_one_program(steps: int, reason: str) -> ValueError:
    return ValueError(f"steps_per_execution={steps} needs the whole step as one program, but {reason}; pass "
                      "steps_per_execution=1 (or 'auto')")
