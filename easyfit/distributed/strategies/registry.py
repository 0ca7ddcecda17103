"""Every strategy easyfit knows, in one table: the names `fit(strategy=...)` takes (the connector) and the classes
`easyfit.strategies` offers are both read from it. A strategy's module is imported when it is first used, so naming
a backend never imports its optional package. A strategy of your own is registered the same way (`register`).
"""
from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

#: a name's constructor keywords, or a function of the call (easyfit.distributed.calls.Call) giving them
Options = Mapping[str, Any] | Callable[[Any], Mapping[str, Any]]


@dataclass(frozen=True)
class Registered:
    """One strategy class: its name in `easyfit.strategies`, where it lives, and the strategy names it serves."""

    public_name: str
    module: str
    class_name: str
    names: Mapping[str, Options] = field(default_factory=dict)
    cls: type | None = None   # a class registered as an object (a user's), rather than found by its module

    def load(self) -> type:
        return self.cls or getattr(importlib.import_module(self.module), self.class_name)

    def build(self, name: str, call):
        options = self.names[name]
        return self.load()(**(options(call) if callable(options) else options))


def _in_strategies(module: str) -> str:
    return f"easyfit.distributed.strategies.{module}"


def _fsdp(cpu_offload: bool) -> Callable[[Any], dict]:
    def options(call) -> dict:
        fork = call.interactive and not call.external   # a notebook cannot re-run itself: its ranks are forked
        return {"cpu_offload": cpu_offload, "start_method": "fork" if fork else "popen"}
    return options


def _two_d(call) -> dict:
    """TP inside pairs of devices (inside each node on several), FSDP over the rest."""
    return {"tensor_parallel_size": 2 if call.num_nodes == 1 else "auto"}


def _deepspeed(stage: int, offload: bool = False) -> dict:
    return {"stage": stage, "offload_optimizer": offload, "offload_parameters": offload and stage == 3}


def _ddp(start_method: str, name: str) -> dict:
    return {"start_method": start_method, "name": name}


#: the strategies easyfit brings, in the order their names are listed in messages
BUILT_IN = (
    Registered("Strategy", _in_strategies("base"), "Strategy"),
    Registered("ParallelStrategy", _in_strategies("parallel"), "ParallelStrategy"),
    Registered("SingleDevice", _in_strategies("single"), "SingleDeviceStrategy", {"single": {}}),
    Registered("DDP", _in_strategies("ddp"), "DDPStrategy", {
        "ddp": _ddp("popen", "ddp"), "ddp_spawn": _ddp("spawn", "ddp_spawn"), "ddp_fork": _ddp("fork", "ddp_fork"),
        "ddp_notebook": _ddp("fork", "ddp_notebook")}),
    Registered("DataParallel", _in_strategies("dp"), "DataParallelStrategy", {"dp": {}}),
    Registered("DDP2", _in_strategies("ddp2"), "DDP2Strategy", {"ddp2": {}}),
    Registered("Zero", _in_strategies("zero"), "ZeroStrategy", {"zero": {}}),
    Registered("FSDP", _in_strategies("fsdp"), "FSDPStrategy", {
        "fsdp": _fsdp(cpu_offload=False), "fsdp_cpu_offload": _fsdp(cpu_offload=True)}),
    Registered("ModelParallel", _in_strategies("tensor_parallel"), "ModelParallelStrategy", {
        "tp": {"data_parallel_size": 1}, "fsdp_tp": _two_d}),
    Registered("DDPSharded", _in_strategies("fairscale"), "ShardedStrategy", {
        "ddp_sharded": {"start_method": "popen"}, "ddp_sharded_spawn": {"start_method": "spawn"}}),
    Registered("DeepSpeed", _in_strategies("deepspeed"), "DeepSpeedStrategy", {
        "deepspeed": _deepspeed(2), "deepspeed_stage_1": _deepspeed(1), "deepspeed_stage_2": _deepspeed(2),
        "deepspeed_stage_2_offload": _deepspeed(2, offload=True), "deepspeed_stage_3": _deepspeed(3),
        "deepspeed_stage_3_offload": _deepspeed(3, offload=True)}),
    Registered("Horovod", _in_strategies("horovod"), "HorovodStrategy", {"horovod": {}}),
    Registered("Bagua", _in_strategies("bagua"), "BaguaStrategy", {"bagua": {}}),
    Registered("Pipeline", _in_strategies("pipeline"), "PipelineStrategy", {"pipeline": {}}),
    Registered("XLA", _in_strategies("xla"), "XLAStrategy", {"xla": {}}),
)
_registered: list[Registered] = list(BUILT_IN)


def register(cls: type, names: Mapping[str, Options] | None = None, public_name: str | None = None) -> None:
    """Make a Strategy subclass of your own available by name: `fit(strategy=name)` for each of `names` (name ->
    constructor keywords; default: the class's `name` attribute, no keywords) and `easyfit.strategies.<public_name>`
    (default: the class name). Under a launcher that re-runs the script, every rank registers it the same way."""
    names = dict(names if names is not None else {cls.name: {}})
    public_name = public_name or cls.__name__
    taken = [name for name in names if name in strategy_names()]
    if taken or public_name in classes():
        raise ValueError(f"strategy name(s) {', '.join(taken or [public_name])} are taken already; pick others")
    _registered.append(Registered(public_name, cls.__module__, cls.__qualname__, names, cls))


def strategy_names() -> list[str]:
    """Every name `fit(strategy=...)` takes, besides "auto"."""
    return [name for entry in _registered for name in entry.names]


def build(name: str, call):
    """A new strategy object for a registered name, configured by its row for this call."""
    return next(entry for entry in _registered if name in entry.names).build(name, call)


def classes() -> dict[str, Registered]:
    """Public name -> its registered class, for `easyfit.strategies`."""
    return {entry.public_name: entry for entry in _registered}
