"""The Strategy contract: everything Model, the loop and the callbacks may ask of a backend.

A strategy makes a fit's objects (`setup` returns the fit's `Fit`), reads and loads their state (on every rank:
collectives for a sharded backend), runs the step and the collectives; its step and state methods take the fit first,
called through it (`fit.backward(loss, precision)`). The base class is a correct single-process backend.

A strategy object is configuration (what the user and the connector set, this rank's placement among it; pickled
to spawned ranks), written by no call: what one call holds in this process (process groups, the CPU cores' share) is
the `CallState` its `setup_environment` returns and its `teardown` releases, and what one fit holds is the `Fit` its
`setup` returns; the call's `RunningCall` holds both.
"""
from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterable
from dataclasses import replace
from typing import Any, Callable

import torch
from torch.utils.data import Sampler

from easyfit.data.batches import interleave
from easyfit.data.samplers import EpochSampler, EvalSampler
from easyfit.distributed.collectives import Collectives
from easyfit.distributed.strategies.capabilities import NAMES, Capabilities
from easyfit.distributed.strategies.states import FIT_CALLS, NOT_LAUNCHED, CallState, Fit, Launched
from easyfit.parts.optimizers import align_state
from easyfit.parts.precision import Precision
from easyfit.saving.checkpoint import load_checkpoint_file, save_checkpoint_file

#: what the methods that take the fit first (a fit's calls, `FIT_CALLS`) took first in the earlier contract
#: (`describe_setup` took nothing)
EARLIER_FIRST_PARAMETERS = ("net", "optimizer", "loss", "path", "user_net", None)
#: the modules `setup` may wrap the user's net in
WRAPPERS = (torch.nn.DataParallel, torch.nn.parallel.DistributedDataParallel)


def unwrap(net: torch.nn.Module) -> torch.nn.Module:
    """The user's module inside the DataParallel / DistributedDataParallel wrapper `setup` put around it (a user's
    net that merely has a `module` attribute is returned as it is)."""
    return net.module if isinstance(net, WRAPPERS) else net


class Capability:
    """A flag read as an attribute of a strategy (or of its class): its `capabilities` entry of that name."""

    def __init__(self, name: str):
        self.name = name

    def __get__(self, strategy, cls=None):
        return getattr((cls if strategy is None else strategy).capabilities, self.name)


def whole_tensors(module: torch.nn.Module, buffers: bool = False) -> list[torch.Tensor]:
    """`module`'s parameters, detached, and with `buffers` its floating buffers (see `Strategy.local_tensors`)."""
    tensors = [param.detach() for param in module.parameters()]
    return tensors + ([b for b in module.buffers() if b.is_floating_point()] if buffers else [])


def flags_as_attributes(cls):
    """Class decorator of the base strategy: each flag also reads as an attribute (`strategy.handles_clipping`)."""
    for name in NAMES:
        setattr(cls, name, Capability(name))
    return cls


def check_contract(cls) -> None:
    """Refuse a strategy class written to the earlier contract, saying what changed."""
    def first(method) -> str | None:
        parameters = list(inspect.signature(method).parameters)[1:]
        return parameters[0] if parameters else None
    old = [name for name in FIT_CALLS.values()
           if callable(vars(cls).get(name)) and first(vars(cls)[name]) in EARLIER_FIRST_PARAMETERS]
    setup = vars(cls).get("setup")
    if callable(setup) and not {"settings", "call"} <= set(inspect.signature(setup).parameters):
        old.append("setup")
    if old:
        raise TypeError(f"{cls.__qualname__} defines {', '.join(old)} as the earlier Strategy contract did. Now "
                        "`setup(net, optimizer, scheduler=None, settings=None, call=None)` returns the fit's object, "
                        "an easyfit.strategies.Fit (a subclass holds what your backend kept in `self.fit_state`), and "
                        "the step and state methods take that fit first, e.g. `backward(self, fit, loss, precision)`, "
                        "`no_sync(self, fit)`, with `fit.net` and `fit.optimizer`; see docs/strategies.md")


def declared(cls, plain_step) -> Capabilities:
    """The class's capabilities: its own declaration or its base's, with the loose flags of the earlier contract
    folded in (and removed from the class); `plain_step`: the base's `optimizer_step`, which a class that defines its
    own is not compiled past unless it says so."""
    own = vars(cls).get("capabilities")
    flags = {name: vars(cls)[name] for name in NAMES if name in vars(cls)}
    dynamic = [name for name, value in flags.items() if isinstance(value, property) or callable(value)]
    if dynamic:
        raise TypeError(f"{cls.__qualname__} defines {', '.join(dynamic)} as a property or method; strategies now "
                        "declare their flags in one frozen `capabilities = Capabilities(...)` (easyfit.strategies."
                        "Capabilities), and a value that depends on the strategy's options is set in __init__: "
                        "self.capabilities = dataclasses.replace(self.capabilities, name=value)")
    for name in flags:
        delattr(cls, name)
    capabilities = replace(own if own is not None else cls.capabilities, **flags)
    if own is None and "optimizer_step" in vars(cls) and "plain_optimizer_step" not in flags:
        capabilities = replace(capabilities, plain_optimizer_step=False)
    if capabilities.plain_optimizer_step is None:
        capabilities = replace(capabilities, plain_optimizer_step=cls.optimizer_step is plain_step)
    return capabilities


@flags_as_attributes
class Strategy:
    """One process's view of a backend. The base class is a correct single-process backend."""

    name = "single"

    #: what this backend can do and what the connector and the loop must know (see capabilities.py); a subclass
    #: declares its own, and each flag also reads as an attribute (`strategy.handles_clipping`)
    capabilities = Capabilities(plain_optimizer_step=True)
    #: set by the connector when strategy="auto" chose this backend for a reason the summary line should give
    auto_reason: str | None = None
    #: set by the connector when the devices were auto-selected (auto_select_gpus): which, for the summary line
    selection_note: str | None = None

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        check_contract(cls)
        cls.capabilities = declared(cls, Strategy.optimizer_step)

    def __init__(self, device: torch.device | str | None = None):
        self.root_device = torch.device(device or "cpu")
        self._device_given = device is not None

    def configure(self, accelerator: str = "cpu", parallel_devices: list[torch.device] | None = None,
                  num_nodes: int = 1, environment=None, process_group_backend: str | None = None) -> None:
        """Fill in every setting the user left unset; the connector calls this with what the call asked for."""
        if not self._device_given and parallel_devices:
            self.root_device = parallel_devices[0]

    # --- identity -------------------------------------------------------------------
    world_size = 1
    global_rank = 0
    local_rank = 0
    node_rank = 0

    @property
    def is_global_zero(self) -> bool:
        return self.global_rank == 0

    def make_launcher(self):
        """A new launcher of a call's ranks (a `easyfit.distributed.launchers.Launcher`): the call's plan makes it
        once and holds it; None: this process is the only rank, or the ranks exist already."""
        return None

    @property
    def batch_factor(self) -> int:
        """Per-process batches that make one global optimizer step."""
        return self.world_size

    def describe_batch_factor(self) -> str:
        """Words for the summary line: what `batch_factor` counts."""
        return "processes" if self.batch_factor != 1 else "process"

    def describe_setup(self, fit: Fit | None = None) -> str | None:
        """Words for the summary line on what `setup` chose for `fit` (None: before one) that the user did not set;
        None: nothing."""
        return None

    def check_precision(self, precision: str) -> None:
        """Raise, before any rank starts, if this backend cannot train in `precision` (a parsed name) here."""

    def check_call(self, call) -> None:
        """Raise if this strategy cannot serve the call (devices, nodes, launcher) as asked, saying what to change."""

    def check_net(self, net: torch.nn.Module) -> None:
        """Raise if this strategy cannot train or run `net` as configured, saying what to change; called before any
        process starts."""

    def processes_per_node(self, call) -> int | None:
        """How many processes per node this strategy runs for the call; None: no check against the launcher."""
        return len(call.devices)

    # --- life -----------------------------------------------------------------------
    def configure_rank(self, local_rank: int) -> None:
        """In a process a launcher started for one rank (spawn, fork, a TPU replica), before its call: that rank's
        configuration (nothing here)."""

    def setup_environment(self, launched: Launched = NOT_LAUNCHED) -> CallState:
        """Create the process group (if any) and select this process's device; `launched`: how the call's ranks came
        to exist. Returns what the call holds in this process until `teardown`."""
        if self.root_device.type == "cuda":
            torch.cuda.set_device(self.root_device)
        return CallState(launched)

    def precision_plugin(self, current: Precision, requested: Any) -> Precision:
        """The precision plugin for this call: `requested` (None: as `current`), on this process's device."""
        return current.for_run(requested, self.root_device)

    def module_construction(self) -> contextlib.AbstractContextManager:
        """A context in which a net is built sharded from the start, taking no full copy of its parameters in any
        process (a null context here: the net is built as usual)."""
        return contextlib.nullcontext()

    def setup(self, net: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler=None, settings=None,
              call: CallState | None = None) -> Fit:
        """The fit's own object: the net (and the optimizer's state) moved to the device and wrapped for the backend,
        built from the fit's `TrainingSettings` (batch size, accumulation, clipping, precision; None: the defaults),
        in the call `call` (what `setup_environment` returned). Model, the loop and the callbacks use its net,
        optimizer and scheduler until the fit ends."""
        net.to(self.root_device)
        align_state(optimizer)
        return Fit(strategy=self, net=net, optimizer=optimizer, scheduler=scheduler, call=call)

    def end_fit(self, fit: Fit, user_net: torch.nn.Module, user_optimizer: torch.optim.Optimizer) -> None:
        """At the end of a fit, on every rank: the full trained weights into the user's net and the full optimizer
        state into the user's optimizer (nothing to do when they were trained in place, as here)."""

    def abandon_fit(self, fit: Fit) -> None:
        """A fit that raised: leave the user's objects usable (nothing to do here)."""

    def module_for_eval(self, fit: Fit) -> torch.nn.Module:
        """The module evaluate / predict run (of the fit's net), on this process's device."""
        return unwrap(fit.net).to(self.root_device)

    def forward_in_lockstep(self, fit: Fit) -> bool:
        """True when `module_for_eval(fit)` is sharded, so its forward is a collective: the loop then makes every
        rank run as many evaluation forwards as the rank with the most batches."""
        return False

    def teardown(self, call: CallState) -> None:
        """Release what `setup_environment` made for `call` (nothing here)."""

    def compile_context(self) -> contextlib.AbstractContextManager:
        """The torch.compile settings (torch._dynamo.config) a compiled call runs under; none here."""
        return contextlib.nullcontext()

    # --- state of a fit's objects (called on every rank) --------------------------------
    def module_state(self, fit: Fit) -> dict:
        """The fit's net's full state dict."""
        return unwrap(fit.net).state_dict()

    def load_module_state(self, fit: Fit, state: dict) -> None:
        unwrap(fit.net).load_state_dict(state)

    def optimizer_state(self, fit: Fit) -> dict:
        return fit.optimizer.state_dict()

    def load_optimizer_state(self, fit: Fit, state: dict) -> None:
        fit.optimizer.load_state_dict(state)

    def local_tensors(self, fit: Fit, buffers: bool = False) -> list[torch.Tensor]:
        """This rank's part of each parameter of the fit's net (what its optimizer steps), in `parameters()`
        order, and with `buffers` of each floating buffer: tensors that share the weights' memory (weight averaging
        updates and swaps them in place). Here the whole parameters."""
        return whole_tensors(unwrap(fit.net), buffers)

    def save_checkpoint(self, fit: Fit, path: str, state: dict) -> None:
        """Write `state` (of `fit`) atomically. Only global rank 0 writes the one file; the other ranks return at
        once."""
        if self.is_global_zero:
            save_checkpoint_file(path, state)

    def load_checkpoint(self, fit: Fit, path: str) -> dict:
        """The checkpoint at `path` (for `fit`), read as data (a file that needs unpickling is refused, see
        saving/checkpoint)."""
        return load_checkpoint_file(path, map_location=self.root_device)

    def device_rng_state(self) -> dict:
        """{checkpoint key: state} of a random generator of this strategy's device besides torch's CPU and CUDA ones
        (XLA's), as numbers or tensors; none here."""
        return {}

    def load_device_rng_state(self, state: dict) -> None:
        """Put back what `device_rng_state` saved in the checkpoint `state` (resuming)."""

    # --- data -----------------------------------------------------------------------
    @property
    def data_parallel_rank(self) -> int:
        """Which share of the data this rank trains on: its rank, unless ranks form groups that take one batch
        together (a pipeline's stages, a tensor-parallel group)."""
        return self.global_rank

    @property
    def data_parallel_size(self) -> int:
        """How many shares the data is split into: one per rank unless ranks form groups (`data_parallel_rank`)."""
        return self.world_size

    def train_sampler(self, dataset_len: int, shuffle: bool, seed: int) -> Sampler:
        return EpochSampler(dataset_len, shuffle=shuffle, seed=seed)

    def eval_sampler(self, dataset_len: int) -> Sampler:
        """Every sample exactly once across all ranks (no padding), so metrics are exact."""
        return EvalSampler(dataset_len, rank=self.data_parallel_rank, world_size=self.data_parallel_size)

    def wrap_user_sampler(self, sampler: Sampler) -> Sampler:
        """Give this rank its share of a sampler the user wrote."""
        return sampler

    @property
    def batch_device(self) -> torch.device:
        """Where the batch sources put each batch: this process's device, unless `feed` moves them itself."""
        return self.root_device

    def feed(self, batches: Iterable) -> Iterable:
        """What the loop iterates in an epoch of training, evaluation or prediction, from the batch source's
        batches (on `batch_device`): they themselves here; a backend with its own loader wraps them (XLA)."""
        return batches

    # --- steps, and where outputs live -------------------------------------------------
    def training_step(self, fit: Fit, inputs: Any, target: Any, step_fn: Callable, precision: Precision,
                      divisor: int = 1) -> tuple[Any, Any, torch.Tensor]:
        """Forward, loss and backward of one batch of the fit's net (the loss divided by `divisor` for the backward:
        an accumulation window). `step_fn(net, inputs, target) -> (output, target, loss)` is the loop's forward and
        loss (on the first batch with its checks, the target as the loss takes it). Returns (output, target, loss):
        the output, or None on a rank that holds no outputs (a pipeline's earlier stages); the batch's undivided loss
        on every rank."""
        with precision.autocast():
            output, target, loss = step_fn(fit.net, inputs, target)
        self.backward(fit, loss / divisor if divisor > 1 else loss, precision)
        return output, target, loss

    def evaluation_step(self, net: torch.nn.Module, inputs: Any, target: Any, step_fn: Callable,
                        precision: Precision) -> tuple[Any, Any, torch.Tensor | None]:
        """The forward (and loss) of one evaluation or prediction batch of `module_for_eval`'s module, with `step_fn`
        as in `training_step` (for predict, its loss is None): (output, or None where this rank holds no outputs;
        the target; the loss on every rank)."""
        with precision.autocast():
            return step_fn(net, inputs, target)

    def gather_outputs(self, local: torch.Tensor) -> torch.Tensor:
        """Every rank's predictions (this rank's: `local`, for its `eval_sampler` share), in input order."""
        return interleave(self.all_gather(local))

    # --- step -----------------------------------------------------------------------
    def backward(self, fit: Fit, loss: torch.Tensor, precision: Precision) -> None:
        precision.backward(loss)

    def optimizer_step(self, fit: Fit, precision: Precision) -> None:
        precision.optimizer_step(fit.optimizer)

    def zero_grad(self, fit: Fit) -> None:
        fit.optimizer.zero_grad(set_to_none=True)

    def uneven_inputs(self, fit: Fit) -> contextlib.AbstractContextManager:
        """A context around an epoch whose number of batches may differ between ranks (data of unknown length):
        a rank that runs out shadows the others' collectives until all are done."""
        return contextlib.nullcontext()

    def no_sync(self, fit: Fit) -> contextlib.AbstractContextManager:
        """Skip gradient synchronisation for an accumulation micro-step."""
        return contextlib.nullcontext()

    def clip_gradients(self, fit: Fit, max_norm: float, precision: Precision) -> None:
        """Clip the fit's gradients to a total norm of `max_norm`, at their true scale (unscaled first)."""
        precision.unscale_gradients(fit.optimizer)
        torch.nn.utils.clip_grad_norm_(fit.net.parameters(), max_norm)

    # --- collectives ----------------------------------------------------------------
    @property
    def collectives(self) -> Collectives:
        """The backend's collectives that `reduce`, `all_gather`, `broadcast` and `barrier` run, built on each use
        (a pickled strategy carries none): one process's here."""
        return Collectives()

    def reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """Reduce over all ranks ("sum", "mean", "max", "min"); identity on one process."""
        return self.collectives.reduce(tensor, op)

    def any_rank(self, flag: bool) -> bool:
        """Whether `flag` is true on any rank: one 1-element all-reduce on `root_device` (none on one process).
        Every rank must ask at the same point."""
        if self.world_size == 1:
            return flag
        return bool(self.reduce(torch.tensor([float(flag)], device=self.root_device), "max").item())

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """This rank's tensor from every rank, in rank order (first dimensions may differ between ranks)."""
        return self.collectives.all_gather(tensor)

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return self.collectives.broadcast(obj, src)

    def barrier(self) -> None:
        """Wait for every rank."""
        self.collectives.barrier()

    def metric_sync_fn(self) -> Callable:
        """The gather function torchmetrics uses to synchronise metric states (its `dist_sync_fn`)."""
        return self._gather_metric_state

    def _gather_metric_state(self, tensor: torch.Tensor, group=None) -> list[torch.Tensor]:
        return self.all_gather(tensor)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(device={self.root_device}, world_size={self.world_size})"
