"""A call's plan: the strategy, its one launcher and the precision, resolved once from the run options, with every
check that needs no data run before any process starts (fit's own options, `FitOptions`, included: each declared
once in easyfit.training.fit_options). The rest of the call reads the plan."""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from easyfit.data.weights import validation_weight
from easyfit.distributed.connector import connect, strategy_name
from easyfit.distributed.fault_tolerance import max_restarts_for
from easyfit.distributed.launcher_choice import check_ray_call, ray_options
from easyfit.distributed.launchers.base import Launcher
from easyfit.distributed.memory import estimate
from easyfit.distributed.run_options import RunOptions
from easyfit.distributed.strategies.base import Strategy
from easyfit.distributed.strategies.states import NOT_LAUNCHED, Launched
from easyfit.distributed.strategy_parts.construction import check_built_sharded
from easyfit.parts.outputs import ModelLoss
from easyfit.parts.precision import parse_precision
from easyfit.training.call_kind import CallKind
from easyfit.training.fit_options import FitOptions, LoopOptions


def check_fit_call(model, options: FitOptions) -> FitOptions:
    """Raise, before any training work, on a fit option that is out of range (each one's own check, `FIT_OPTIONS`)
    or that does not fit another or the Model's loss, saying what is accepted; the options in the forms easyfit uses
    (the forms Keras accepts brought to them), with launch()'s default number of restarts."""
    options = options.checked()
    check_validation_and_weights(options, model.loss_fn)
    return options.replace(max_restarts=max_restarts_for(options.max_restarts))


def check_loop_call(model, options: LoopOptions) -> LoopOptions:
    """evaluate's and predict's options in range, the callbacks as a list."""
    return options.checked()


def compile_settings(value: Any, strategy, options: FitOptions, model, precision: str) -> dict | None:
    """`compile` as torch.compile's settings, checked against the call (easyfit.compiled.settings, imported only when
    compile= asks for it); None: eager, where more than one step per call is refused."""
    if value is None or value is False:
        steps = options.steps_per_execution
        if steps not in ("auto", 1):
            raise ValueError(f"steps_per_execution={steps} runs {steps} steps as one compiled program, which needs "
                             "compile=True (or a torch.compile mode); pass compile=True, or steps_per_execution=1")
        return None
    from easyfit.compiled.settings import check_compile
    return check_compile(value, strategy, options, model, precision)


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


@dataclass(frozen=True)
class Plan:
    """What one call of `kind` runs: on `strategy`, its ranks started by `launcher` (None: in this process, or the
    ranks exist already), in `precision`."""
    kind: CallKind
    run: RunOptions
    strategy: Strategy
    launcher: Launcher | None
    precision: str
    #: global rank 0 runs in another process than the caller, so it sends its results and state back
    rank_zero_elsewhere: bool
    #: the `compile` option as torch.compile's settings (None: eager)
    compiling: dict | None
    #: the call's options, checked and completed (`kind.check`)
    options: Any = None
    #: how the call's ranks come to exist, as each rank sees it (kept in a copy sent to a rank, and by a Ray worker)
    launched: Launched = NOT_LAUNCHED

    def __getstate__(self) -> dict:
        """A copy sent to a spawned rank leaves the caller's launcher behind."""
        return {**self.__dict__, "launcher": None}


def plan_call(model, kind: CallKind, run: RunOptions, options: Any = None) -> Plan:
    """The plan of a call of `kind` with these run options (and the call's `options`, checked and completed here);
    raises on what cannot run."""
    if kind.check is not None:
        options = kind.check(model, options)
    on_ray = ray_options(run.launcher)
    placement = run.placement()
    if on_ray is not None:   # the workers resolve the nodes and their devices; here every check before Ray starts
        check_ray_call(kind.name, run.strategy.name if isinstance(run.strategy, Strategy) else
                       strategy_name(run.strategy))
        placement = {**placement, "num_nodes": 1, "strategy": _checked_here(run.strategy),
                     "accelerator": _accelerator_here(run.accelerator)}
    strategy = connect(training_memory=estimate(model.net, model.optimizer) if kind.trains else None,
                       ranks_elsewhere=on_ray is not None, **placement)
    check_built_sharded(model.net, kind.trains, strategy.capabilities.trains_built_sharded)
    precision = parse_precision(run.precision or model.precision.name)
    strategy.check_precision(precision)
    strategy.check_net(model.net)
    if isinstance(model.loss_fn, ModelLoss) and not strategy.capabilities.forward_takes_targets:
        raise ValueError(f"loss='model' passes the targets into the net's forward (labels=), but "
                         f"strategy={strategy.name!r} runs the net as a chain of stages that each take one input. "
                         "Pass a loss by name (e.g. loss='cross_entropy') for the last stage's output instead.")
    compiling = compile_settings(run.compile, strategy, options if kind.trains else FitOptions(), model, precision)
    if on_ray is not None:
        from easyfit.distributed.launchers.ray_train import RayLauncher
        launcher = RayLauncher(on_ray, getattr(strategy, "num_processes", 1), run.num_nodes, run.accelerator,
                               options.max_restarts if kind.trains else 0, worker_plan)
        return Plan(kind, run, strategy, launcher, precision, True, compiling, options)
    launcher = strategy.make_launcher()
    elsewhere = launcher is not None and not launcher.rank_zero_in_caller
    launched = Launched(by_easyfit=launcher is not None, for_this_call=elsewhere)
    if kind.trains:
        from easyfit.distributed.launchers.restarts import with_restarts
        launcher = with_restarts(launcher, strategy, options, model)
    return Plan(kind, run, strategy, launcher, precision, elsewhere, compiling, options, launched)


def worker_plan(plan: Plan, model, options: Any) -> Plan:
    """The plan of a call in a worker of launcher="ray": made again there, where Ray's worker context is the launch
    environment (as torchrun's would be), on the devices of the workers Ray placed on this node; rank 0 hands its
    result and state back to the caller."""
    planned = plan_call(model, plan.kind, plan.run.replace(launcher="auto", devices="auto"), options)
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
