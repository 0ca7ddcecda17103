"""A call's plan: the strategy, its one launcher and the precision, resolved once from the run options, with every
check that needs no data run before any process starts (fit's own options, `FitOptions`, included). The rest of the
call reads the plan."""
from __future__ import annotations

import os
from dataclasses import dataclass, fields, replace
from typing import Any

from easyfit.callbacks.base import callback_list
from easyfit.data.weights import validation_weight
from easyfit.distributed.connector import connect, strategy_name
from easyfit.distributed.fault_tolerance import max_restarts_for
from easyfit.distributed.launcher_choice import check_ray_call, ray_options
from easyfit.distributed.launchers.base import Launcher
from easyfit.distributed.memory import estimate
from easyfit.distributed.run_options import RunOptions, refuse_unknown
from easyfit.distributed.strategies.base import Strategy
from easyfit.distributed.strategy_parts.construction import check_built_sharded
from easyfit.parts.lr_scaling import lr_multiplier
from easyfit.parts.outputs import ModelLoss
from easyfit.parts.precision import parse_precision
from easyfit.training.compiling import check_compile
from easyfit.utils.checks import (
    check_non_negative_int,
    check_positive_int,
    check_positive_number,
    check_verbose,
    validation_tuple,
)


@dataclass
class FitOptions:
    """What fit accepts besides the run options; docs/api.md describes each."""
    epochs: int = 1
    batch_size: int = 32
    validation_data: Any = None
    validation_split: float = 0.0
    validation_batch_size: int | None = None
    validation_freq: int = 1
    shuffle: bool = True
    seed: int = 0
    verbose: int | str = "auto"
    callbacks: Any = None   # a list after check_fit_options
    initial_epoch: int = 0
    resume_from: str | None = None
    gradient_accumulation_steps: int = 1
    gradient_clip_val: float | None = None
    lr_scaling: str | None = "linear"
    lr_warmup_epochs: int = 0
    sample_weight: Any = None
    class_weight: dict | None = None
    steps_per_epoch: int | None = None
    validation_steps: int | None = None
    max_restarts: int | None = None   # None: as easyfit.launch(max_restarts=...) said, else 0
    fault_tolerance: Any = None       # None: on under a launcher that restarts ranks; False: off; a folder
    fault_tolerance_every_n_steps: int | None = None
    steps_per_execution: Any = "auto"   # int or "auto": training steps per compiled call (easyfit.training.multi_step)


def fit_options(arguments: dict) -> FitOptions:
    """fit's options, from its arguments (its `locals()`)."""
    return FitOptions(**{f.name: arguments[f.name] for f in fields(FitOptions)})


def split_options(kwargs: dict, *option_types) -> list:
    """Build each options dataclass from the keyword arguments it knows; reject the rest by name."""
    refuse_unknown(kwargs, [f.name for option_type in option_types for f in fields(option_type)])
    return [option_type(**{f.name: kwargs[f.name] for f in fields(option_type) if f.name in kwargs})
            for option_type in option_types]


def check_fit_options(options: FitOptions, loss_fn=None) -> None:
    """Raise, before any training work, on a fit option that is out of range or that does not fit the Model's
    loss (`loss_fn`), saying what is accepted."""
    check_positive_int(options.batch_size, "batch_size")
    if not (type(options.epochs) is int and options.epochs == 0):   # 0 trains nothing: an empty History
        check_positive_int(options.epochs, "epochs", "a non-negative integer")
    for name in ("steps_per_epoch", "validation_steps"):
        if getattr(options, name) is not None:
            check_positive_int(getattr(options, name), name, "a positive integer or None")
    check_positive_int(options.gradient_accumulation_steps, "gradient_accumulation_steps")
    if options.gradient_clip_val is not None:   # 0 would freeze training, a negative value reverse it
        check_positive_number(options.gradient_clip_val, "gradient_clip_val",
                              "a positive number (the largest total gradient norm), or None for no clipping")
    lr_multiplier(options.lr_scaling, 1)
    check_fault_tolerance(options)
    check_fit_arguments(options)
    check_validation_and_weights(options, loss_fn)


def check_validation_and_weights(options: FitOptions, loss_fn) -> None:
    """The validation and weight options, against each other and the loss."""
    if options.validation_split and options.validation_data is not None:
        raise ValueError("pass either validation_data or validation_split, not both")
    if options.sample_weight is not None and options.class_weight is not None:
        raise ValueError("pass sample_weight or class_weight, not both (combine them into one sample_weight)")
    weighted = (options.sample_weight is not None or options.class_weight is not None
                or validation_weight(options.validation_data)[1] is not None)
    if weighted and isinstance(loss_fn, ModelLoss):
        raise ValueError("sample and class weights weigh each sample's loss, but loss='model' trains on the one "
                         "loss the net returns for the batch; weigh inside the net, or pass a loss by name")


def check_fault_tolerance(options: FitOptions) -> None:
    """max_restarts, fault_tolerance and fault_tolerance_every_n_steps (docs/fault-tolerance.md)."""
    if options.max_restarts is not None and not (type(options.max_restarts) is int and options.max_restarts >= 0):
        raise ValueError(f"max_restarts must be a non-negative integer (how often easyfit's launcher restarts the "
                         f"ranks after a failure), got {options.max_restarts!r}")
    if options.fault_tolerance_every_n_steps is not None:
        check_positive_int(options.fault_tolerance_every_n_steps, "fault_tolerance_every_n_steps",
                           "a positive number of optimizer steps, or None (a checkpoint at each epoch end only)")
    option = options.fault_tolerance
    if option not in (None, True, False) and not isinstance(option, (str, os.PathLike)):
        raise TypeError(f"fault_tolerance must be False (off), True / None (on under a launcher that restarts "
                        f"ranks) or the folder of its checkpoints, got {type(option).__name__}")


def check_fit_arguments(options) -> None:
    """Check fit's options (a FitOptions) and bring the forms Keras accepts to the one easyfit uses."""
    check_positive_int(options.validation_freq, "validation_freq")
    check_non_negative_int(options.initial_epoch, "initial_epoch",
                           "a non-negative integer (the epoch to start at, counted from 0)")
    check_verbose(options.verbose)
    if not isinstance(options.shuffle, bool):
        raise TypeError(f"shuffle must be True or False, got {options.shuffle!r}")
    options.callbacks = callback_list(options.callbacks)
    options.validation_data = validation_tuple(options.validation_data)


@dataclass(frozen=True)
class Plan:
    """What one fit / evaluate / predict call runs: `method` on `strategy`, its ranks started by `launcher` (None: in
    this process, or the ranks exist already), in `precision`."""
    method: str
    run: RunOptions
    strategy: Strategy
    launcher: Launcher | None
    precision: str
    #: global rank 0 runs in another process than the caller, so it sends its results and state back
    rank_zero_elsewhere: bool

    def __getstate__(self) -> dict:
        """A copy sent to a spawned rank leaves the caller's launcher behind."""
        return {**self.__dict__, "launcher": None}


def plan_call(model, method: str, run: RunOptions, options: Any = None) -> Plan:
    """The plan of `model.<method>(...)` with these run options (and fit's `options`, checked and completed here);
    raises on what cannot run."""
    if method == "fit":
        check_fit_options(options, model.loss_fn)
        options.max_restarts = max_restarts_for(options.max_restarts)   # launch()'s default
    on_ray = ray_options(run.launcher)
    placement = run.placement()
    if on_ray is not None:   # the workers resolve the nodes and their devices; here every check before Ray starts
        check_ray_call(method, run.strategy.name if isinstance(run.strategy, Strategy) else
                       strategy_name(run.strategy))
        placement = {**placement, "num_nodes": 1, "strategy": _checked_here(run.strategy),
                     "accelerator": _accelerator_here(run.accelerator)}
    strategy = connect(training_memory=estimate(model.net, model.optimizer) if method == "fit" else None,
                       ranks_elsewhere=on_ray is not None, **placement)
    check_built_sharded(model.net, method, strategy.trains_built_sharded)
    precision = parse_precision(run.precision or model.precision.name)
    strategy.check_precision(precision)
    strategy.check_net(model.net)
    if isinstance(model.loss_fn, ModelLoss) and not strategy.forward_takes_targets:
        raise ValueError(f"loss='model' passes the targets into the net's forward (labels=), but "
                         f"strategy={strategy.name!r} runs the net as a chain of stages that each take one input. "
                         "Pass a loss by name (e.g. loss='cross_entropy') for the last stage's output instead.")
    check_compile(run.compile, strategy, options)
    if on_ray is not None:
        from easyfit.distributed.launchers.ray_train import RayLauncher
        launcher = RayLauncher(on_ray, getattr(strategy, "num_processes", 1), run.num_nodes, run.accelerator,
                               options.max_restarts if method == "fit" else 0, worker_plan)
        return Plan(method, run, strategy, launcher, precision, True)
    launcher = strategy.launcher
    if method == "fit":
        from easyfit.distributed.launchers.restarts import with_restarts
        launcher = with_restarts(launcher, strategy, options, model)
    elsewhere = launcher is not None and not launcher.rank_zero_in_caller
    return Plan(method, run, strategy, launcher, precision, elsewhere)


def worker_plan(plan: Plan, model, options: Any) -> Plan:
    """The plan of a call in a worker of launcher="ray": made again there, where Ray's worker context is the launch
    environment (as torchrun's would be), on the devices of the workers Ray placed on this node; rank 0 hands its
    result and state back to the caller."""
    planned = plan_call(model, plan.method, plan.run.replace(launcher="auto", devices="auto"), options)
    return replace(planned, launcher=None, rank_zero_elsewhere=True)


def _checked_here(strategy):
    """The caller of launcher="ray" checks the call on a copy of a strategy object: the workers configure theirs."""
    import copy
    return copy.deepcopy(strategy) if isinstance(strategy, Strategy) else strategy


def _accelerator_here(accelerator: str) -> str:
    """A caller without the GPUs of the cluster's workers (a CPU head node) checks a GPU call as a CPU one."""
    import torch
    wants_gpu = str(accelerator).lower() in ("gpu", "cuda")
    return "cpu" if wants_gpu and not torch.cuda.is_available() else accelerator
