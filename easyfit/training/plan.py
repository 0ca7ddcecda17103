"""A call's plan: the strategy, its one launcher and the precision, resolved once from the run options, with every
check that needs no data run before any process starts. The rest of the call reads the plan."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from easyfit.distributed.connector import connect
from easyfit.distributed.launchers.base import Launcher
from easyfit.distributed.memory import estimate
from easyfit.distributed.run_options import RunOptions
from easyfit.distributed.strategies.base import Strategy
from easyfit.distributed.strategy_parts.construction import check_built_sharded
from easyfit.parts.outputs import ModelLoss
from easyfit.parts.precision import parse_precision
from easyfit.training.compiling import check_compile


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
    """The plan of `model.<method>(...)` with these run options (and fit's `options`); raises on what cannot run."""
    strategy = connect(training_memory=estimate(model.net, model.optimizer) if method == "fit" else None,
                       **run.placement())
    check_built_sharded(model.net, method, strategy.trains_built_sharded)
    precision = parse_precision(run.precision or model.precision.name)
    strategy.check_precision(precision)
    strategy.check_net(model.net)
    if isinstance(model.loss_fn, ModelLoss) and not strategy.forward_takes_targets:
        raise ValueError(f"loss='model' passes the targets into the net's forward (labels=), but "
                         f"strategy={strategy.name!r} runs the net as a chain of stages that each take one input. "
                         "Pass a loss by name (e.g. loss='cross_entropy') for the last stage's output instead.")
    check_compile(run.compile, strategy, options)
    launcher = strategy.launcher
    if method == "fit":
        from easyfit.distributed.launchers.restarts import with_restarts
        launcher = with_restarts(launcher, strategy, options, model)
    elsewhere = launcher is not None and not launcher.rank_zero_in_caller
    return Plan(method, run, strategy, launcher, precision, elsewhere)

