"""fit(compile=..., steps_per_execution=N): an epoch's training steps as compiled programs of N steps each.

Each call runs N optimizer steps (forward, loss, backward, clipping, update: easyfit.compiled.functional_step) over
N batches taken from the epoch's batches, as Keras' `steps_per_execution` does. The learning rate of each step
(warmup, a per-step schedule) is worked out before the call, the losses are tracked and the metrics updated batch by
batch after it, and the batch hooks see every N-th batch:
`on_train_batch_begin` the call's first, and `on_train_batch_end` its last. Epoch hooks, metrics, checkpoints and
the History see what an eager fit shows.

Batches of other shapes than the first run eagerly: an epoch's short last batch, so the batch dimension stays
static; and once batches change size mid-epoch (sequences padded per batch), the fit's steps go to the separately
compiled parts, which compile the changing dimensions as dynamic (easyfit.compiled.shape_family), said once. A run
of fewer than N batches before an eager one (or at the end of the epoch) runs through the one-step program.
"""
from __future__ import annotations

import dataclasses
import warnings
from typing import Callable

import torch

from easyfit.compiled import functional_step as fs
from easyfit.compiled.direct_call import DirectProgram
from easyfit.compiled.settings import compile_arguments, replays_cuda_graphs, steps_need_one_program, whole_step_refusal
from easyfit.compiled.shape_family import ShapeFamily
from easyfit.data.batches import TensorBatches, batch_source
from easyfit.data.contents import split_batch
from easyfit.data.weights import WeightedLoss
from easyfit.utils.torch_internals import is_dynamo_error, mode_options

#: steps per call of "auto" for a small step (see `steps_per_call`)
AUTO_STEPS = 8
#: "auto" runs several steps per call when parameters × batch size is below this: the step is then dominated by
#: the cost of calls, not arithmetic (the 32-64-10 MLP at batch 64: 1.7e5; the 784-1024-1024-10 one at 128: 2.4e8)
SMALL_STEP = 1 << 24


def steps_per_call(value, callbacks, net: torch.nn.Module, batch_size: int, accumulate: int) -> int:
    """N for the fit: `value`, or for "auto" AUTO_STEPS (a multiple of `accumulate`) on a small step when no callback
    needs every batch's hooks, else 1."""
    if value != "auto":
        return value
    if any(callback.needs_every_batch for callback in callbacks.callbacks) or not small_step(net, batch_size):
        return 1
    return accumulate * -(-AUTO_STEPS // accumulate)


def small_step(net: torch.nn.Module, batch_size: int) -> bool:
    """Whether a step is bound by the cost of calls rather than arithmetic (parameters × batch size < SMALL_STEP)."""
    return sum(p.numel() for p in net.parameters()) * batch_size < SMALL_STEP


def fixed_shapes(batches) -> bool:
    """Whether every batch of `batches` has the first one's shapes (but a short last one): in-memory tensors, indexed
    by easyfit; a DataLoader or a collate function may pad each batch to its own length."""
    return isinstance(batch_source(batches), TensorBatches)


def whole_step_runner(loop, settings: dict, cached: Callable, declined: set) -> FusedTraining | None:
    """The runner of whole-step programs for a fit's Loop under torch.compile's `settings`, its programs kept by
    `cached(key, build)`; None, said once per reason (`declined`): the loop's step runs the compiled parts, which an
    explicit steps_per_execution > 1 refuses."""
    value = loop.settings.steps_per_execution
    reason = whole_step_refusal(loop.net, loop.optimizer, loop.precision.scaler is not None, loop.strategy)
    if reason is None and loop.items is not None:   # the one reason that depends on the data (its targets)
        reason = "the loss averages over counted items (tokens), whose number divides each step"
    if reason is not None:
        if value not in ("auto", 1):
            raise steps_need_one_program(value, reason)
        if reason not in declined:
            declined.add(reason)
            warnings.warn(f"compile=: {reason}; the forward with the loss and the optimizer step are compiled "
                          "as separate calls, not as one program", stacklevel=4)
        return None
    loss = getattr(loop.loss_fn, "loss_fn", loop.loss_fn)   # a fit with weights wraps the Model's loss anew
    # the programs depend on the optimizer's class, the order of its parameters and their shapes, not on the
    # object: a new optimizer of the same kind over the same net (compile() before fitting again) reuses them
    names = fs.ParameterNames(loop.net, loop.optimizer)
    programs = cached(("programs", id(loop.net), type(loop.optimizer), tuple(names.names),
                       fs.shapes_of(names.params, names.buffers), id(loss), repr(settings),
                       loop.settings.step_key()), dict)
    extra = {}
    if loop.strategy.root_device.type == "cpu" and small_step(loop.net, loop.settings.batch_size) and \
            not mode_options(settings.get("mode")).get("fallback_by_default"):
        # the kernels called from C++, not from Python: less per call, but slower matrix products, so only where
        # calls cost more than arithmetic (the figures: docs/performance.md, "The whole step as one program");
        # not where a mode leaves most operations to torch's eager kernels ("lite"), which the C++ wrapper's
        # calls into them fail on (torch 2.15: pow with a number first)
        extra["cpp_wrapper"] = True
    arguments = compile_arguments({**settings, "fullgraph": True, "dynamic": False}, extra)

    def build(key, kind, names):
        return DirectProgram(fs.own_cache(fs.make_program(key, kind, names.names, names.buffer_names)), arguments,
                             len(key.steps) if key.outputs else 0)
    steps = steps_per_call(value, loop.callbacks, loop.net, loop.settings.batch_size,
                           loop.settings.gradient_accumulation_steps)
    runner = FusedTraining(loop, steps, build, programs, names)
    runner.cuda_graphs = replays_cuda_graphs(settings)
    return runner


class NotTraced(Exception):
    """torch.compile could not trace or compile a whole-step program (nothing of it ran)."""


class FusedTraining:
    """The fit's `StepRunner` (easyfit.training.steps): trains the rest of an epoch with programs of `steps` steps;
    built by `whole_step_runner`, its `programs` kept by the Model's compiled steps."""

    def __init__(self, loop, steps: int, build, programs: dict, names: fs.ParameterNames):
        self.loop, self.steps, self.build, self.programs, self.names = loop, steps, build, programs, names
        self.family: ShapeFamily | None = None
        self.rates: torch.Tensor | None = None
        self.rate_values: list | None = None
        self.cuda_graphs = self.declined = False
        self.state_lists, self.state_of = None, None
        self.capturable_before: list | None = None   # the optimizer's groups' `capturable` flags before the programs
        self.found: dict = {}   # (steps, optimizer settings, weighted, trainable): program, for this fit
        #: whether the batches keep their shapes, so a program compiled for them will be used: None until the first
        #: batches come; True for in-memory tensors; for other data, once a whole epoch kept them (until then, and
        #: for good once a batch changes size, the step runs in parts, which take changing sizes as dynamic)
        self.trusted: bool | None = None

    def ready(self, step: int) -> bool:
        """Whether the programs can take over at batch `step`: at the start of an accumulation window, with the
        optimizer's state made by the eager first step (else, once warned, the fit's steps run part by part)."""
        if self.declined or step % self.loop.settings.gradient_accumulation_steps:
            return False
        if fs.state_ready(self.loop.optimizer):
            before = fs.capturable(self.loop.optimizer)
            self.capturable_before = before if self.capturable_before is None else self.capturable_before
            if self.cuda_graphs:   # the steps before ran in parts, their gradients in the graphs' pool
                fs.leave_graph_pool(self.names.params)
            return True
        self._decline()
        warnings.warn("compile=: a parameter got no gradient in the first step, so the optimizer skips it and the "
                      "whole step cannot be one program; its parts are compiled one by one instead", stacklevel=3)
        return False

    def train(self, batches, step: int, epoch_run) -> int:
        """Train `batches` (an iterator) from batch index `step`; the index of the last batch trained."""
        return self._train(batches, step, epoch_run)[0]

    def _train(self, batches, step: int, epoch_run) -> tuple[int, bool]:
        loop, precision, pending, raw = self.loop, self.loop.precision, [], []
        weighted = isinstance(loop.loss_fn, WeightedLoss)
        if self.trusted is None:
            self.trusted = fixed_shapes(epoch_run.batches)
        last = step - 1
        for last, batch in enumerate(batches, step):
            inputs, target = split_batch(precision.convert_input(batch))
            weights = loop.loss_fn.weights if weighted else None
            shapes = fs.shapes_of(inputs, target, weights)
            closing = last + 1 == epoch_run.num_batches
            if self.family is None and not closing:   # a short last batch does not set the shapes
                self.family = ShapeFamily(shapes, may_free=False)
            if self.declined or self.family is None or not self.family.takes(shapes, closing) or not self.trusted:
                # eagerly or in parts, after the batches before it (in parts too once the fit declined: no
                # program is compiled for batches the fit will not take again; and while the shapes are watched)
                stopped = self._train_in_parts(raw, epoch_run) if self._decline_resized() else \
                    self._flush(pending, raw, epoch_run)
                if stopped or self._train_in_parts([(last, batch, weights)], epoch_run):
                    return last, True
                pending, raw = [], []
                continue
            pending.append((last, inputs, target, weights))
            raw.append((last, batch, weights))
            if len(pending) == self.steps:
                if self._call_or_decline(pending, raw, epoch_run):
                    return last, True
                pending, raw = [], []
        self.trusted = not self.declined   # an epoch's batches kept their shapes: the next epochs are programs
        return last, self._flush(pending, raw, epoch_run)

    def _decline_resized(self) -> bool:
        """Whether the fit has declined the whole-step programs (now or before): batches that change size (sequences
        padded per batch) go to the separately compiled parts, which compile the changing dimensions as dynamic;
        said once."""
        if self.family is not None and self.family.resized and not self.declined:
            self._decline()
            warnings.warn("compile=: the batches change size between batches, which the whole-step program does not "
                          "take; the step runs as separately compiled parts (forward with loss, optimizer step) "
                          "with the changing dimensions dynamic", stacklevel=4)
            return True
        return self.declined

    def _decline(self) -> None:
        """The rest of the fit runs in parts, as a fit that never had programs: the optimizer as the user made it
        (not capturable unless it was) and its step compiled on its own."""
        loop, self.declined = self.loop, True
        fs.uncapturable(loop.optimizer, self.capturable_before)
        loop.step_in_parts()

    def _flush(self, pending: list, raw: list, epoch_run) -> bool:
        """The batches of a run shorter than N, one per call (in parts once the fit declined: the program it could
        not trace is not traced again for each batch)."""
        for position, (item, held) in enumerate(zip(pending, raw)):
            if self.declined:
                return self._train_in_parts(raw[position:], epoch_run)
            if self._call_or_decline([item], [held], epoch_run):
                return True
        return False

    def _call_or_decline(self, items: list, raw: list, epoch_run) -> bool:
        """One program over `items`; where torch.compile cannot trace or compile it (a layer it does not take, an
        operator under autocast it cannot differentiate twice), the fit declines the whole-step programs, says so
        once, and trains these batches (`raw`) and the rest in parts. Whether a callback asked to stop."""
        try:
            return self._call(items, epoch_run)
        except NotTraced as declined:
            self._decline()
            warnings.warn(f"compile=: torch.compile cannot make the training step one program here ({declined}); "
                          "the step runs as separately compiled parts (forward with loss, optimizer step)",
                          stacklevel=5)
        return self._train_in_parts(raw, epoch_run, begun=True)

    def _train_in_parts(self, raw: list, epoch_run, begun: bool = False) -> bool:
        """Batches held for a program, trained step by step in parts, each with its own sample weights (`begun`: the
        first one's begin callback has run); whether a callback asked to stop."""
        loop, first = self.loop, dataclasses.replace(epoch_run, batch_begin=False) if begun else epoch_run
        for position, (index, batch, weights) in enumerate(raw):
            if isinstance(loop.loss_fn, WeightedLoss):
                loop.loss_fn.weights = weights
            if loop.train_batch(index, batch, first if position == 0 else epoch_run):
                return True
        return False

    def _call(self, items: list, epoch_run) -> bool:
        """One program over `items`; whether a callback asked to stop."""
        loop = self.loop
        loop.begin_batch(items[0][0], epoch_run)
        accumulate, num_batches = epoch_run.accumulate, epoch_run.num_batches
        pattern = tuple(((s % accumulate == 0), (s + 1) % accumulate == 0 or s + 1 == num_batches)
                        for s, _, _, _ in items)
        schedule = self._schedule_position()
        rates = self._rates(pattern)
        program = self._program(pattern, items[0][3] is not None, epoch_run)
        params = self.names.params
        if self.cuda_graphs:
            torch.compiler.cudagraph_mark_step_begin()
        try:
            losses, outputs = program(loop.net, loop.loss_fn, params, self.names.buffers, fs.ensure_grads(params),
                                      self._state(), [item[1] for item in items],
                                      [item[2] for item in items], [item[3] for item in items], rates)
        except Exception as error:
            if not is_dynamo_error(error):
                raise
            self._restore_schedule(schedule)   # raised while tracing or compiling, before any of the program ran
            raise NotTraced(f"{type(error).__name__}: {str(error).strip().splitlines()[0]}") from error
        if self.cuda_graphs:   # the next replay overwrites the graph's outputs: the tracker keeps the losses
            losses = losses.clone()
        loop.optimizer._opt_called = True   # what an LR scheduler's wrapper of `step` records (it was bypassed)
        size = 0
        for (_, inputs, target, _), loss, output in zip(items, losses.unbind(), outputs or [None] * len(items)):
            size = loop.track(epoch_run, loss, inputs, target, output)
        return loop.end_batch(items[-1][0], epoch_run, losses[-1], size)

    def _schedule_position(self) -> tuple:
        """What `_rates` advances (the optimizer step count, the learning rates, a per-step schedule's state)."""
        scheduler = self.loop.scheduler
        return (self.loop.optimizer_steps, [group["lr"] for group in self.loop.optimizer.param_groups],
                None if scheduler is None else dict(vars(scheduler)))

    def _restore_schedule(self, position: tuple) -> None:
        self.loop.optimizer_steps, rates, scheduler = position
        for group, rate in zip(self.loop.optimizer.param_groups, rates):
            group["lr"] = rate
        if scheduler is not None:
            vars(self.loop.scheduler).update(scheduler)

    def _state(self) -> list:
        """The optimizer's state tensors, gathered again when its state was replaced (loaded) or grew."""
        state = self.loop.optimizer.state
        if self.state_of != (id(state), len(state)):
            self.state_lists, self.state_of = fs.state_tensors(self.loop.optimizer), (id(state), len(state))
        return self.state_lists

    def _rates(self, pattern: tuple) -> torch.Tensor:
        """Each step's learning rate per group, as the eager loop sets them (the fit's scale and warmup, a per-step
        schedule)."""
        loop, values = self.loop, []
        groups = loop.optimizer.param_groups
        for _, last in pattern:
            if last:
                loop.before_step()
                values.append([float(group["lr"]) for group in groups])
                loop.after_step()
            else:
                values.append([0.0] * len(groups))
        if values != self.rate_values:
            params = self.names.params
            self.rates = torch.tensor(values, dtype=torch.float64, device=params[0].device)
            self.rate_values = values
        return self.rates

    def _program(self, pattern: tuple, weighted: bool, epoch_run):
        """The program for these steps: what changes between calls is looked up first, the rest is this fit's."""
        loop = self.loop
        settings = fs.optimizer_settings(loop.optimizer)
        trainable = tuple(p.requires_grad for p in self.names.params)
        program = self.found.get((pattern, settings, weighted, trainable))
        if program is None:
            key = fs.ProgramKey(pattern, self.family.first, settings, epoch_run.divisor,
                                loop.settings.gradient_clip_val, loop.precision.autocast_dtype, weighted,
                                bool(loop.metrics), trainable)
            if key not in self.programs:
                self.programs[key] = self.build(key, type(loop.optimizer), self.names)
            program = self.found[pattern, settings, weighted, trainable] = self.programs[key]
        return program
