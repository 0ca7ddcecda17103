"""The dispatcher: (strategy, devices, accelerator, num_nodes, launch environment) -> Strategy.

Precedence, top wins:
  1. A Strategy object beats a name; whatever it leaves unset is filled in from the call.
  2. What a launcher says (torchrun, SLURM, horovodrun/mpirun, the deepspeed launcher, or an easyfit-started rank)
     beats guessing: the processes exist already, so the world size is theirs, and devices="auto" adopts it.
  3. An explicit strategy name beats "auto".
  4. "auto": several nodes -> ddp; one device -> single; several devices in a script -> ddp, in a notebook or
     REPL -> ddp_fork (a notebook cannot re-run itself, and fork needs no pickling).
Conflicts raise an error that says what to change.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

import torch

from easyfit.devices import is_interactive, parse_devices, resolve_accelerator
from easyfit.distributed.environments import ClusterEnvironment, detect_environment
from easyfit.distributed.strategies.base import Strategy
from easyfit.validation import check_positive_int, closest_name


@dataclass(frozen=True)
class Call:
    """What a fit / evaluate / predict call asked for, after parsing."""
    accelerator: str
    devices: list[torch.device]
    num_nodes: int
    environment: ClusterEnvironment
    process_group_backend: str | None
    interactive: bool

    @property
    def external(self) -> bool:
        return self.environment.creates_processes_externally


def _single(call: Call) -> Strategy:
    from easyfit.distributed.strategies.single import SingleDeviceStrategy
    if len(call.devices) > 1 or call.num_nodes > 1:
        raise ValueError(f"strategy='single' runs one process on one device, but this call asks for "
                         f"{len(call.devices)} device(s) × {call.num_nodes} node(s). Use strategy='ddp' or 'auto', "
                         "or devices=1 and num_nodes=1.")
    return SingleDeviceStrategy(call.devices[0])


def _ddp(start_method: str) -> Callable[[Call], Strategy]:
    def build(call: Call) -> Strategy:
        from easyfit.distributed.strategies.ddp import DDPStrategy
        return DDPStrategy(start_method=start_method)
    return build


def _dp(call: Call) -> Strategy:
    from easyfit.distributed.strategies.dp import DataParallelStrategy
    if call.num_nodes > 1:
        raise ValueError("strategy='dp' runs in one process on one node; for several nodes use 'ddp', or 'ddp2' "
                         "(DataParallel inside each node, DDP across nodes)")
    return DataParallelStrategy(call.devices)


def _ddp2(call: Call) -> Strategy:
    from easyfit.distributed.strategies.ddp2 import DDP2Strategy
    return DDP2Strategy()


#: name -> builder. A new backend is one module plus one row here.
STRATEGIES: dict[str, Callable[[Call], Strategy]] = {
    "single": _single,
    "ddp": _ddp("popen"),
    "ddp_spawn": _ddp("spawn"),
    "ddp_fork": _ddp("fork"),
    "ddp_notebook": _ddp("fork"),
    "dp": _dp,
    "ddp2": _ddp2,
}
#: names of backends that later versions of easyfit add
PLANNED = ("horovod", "bagua", "ddp_sharded", "fsdp", "deepspeed", "deepspeed_stage_2", "deepspeed_stage_3")
SPAWNING = ("ddp_spawn", "ddp_fork", "ddp_notebook")


def auto_strategy_name(call: Call) -> str:
    """Rule 4 of the module docstring."""
    if call.num_nodes > 1 or (call.external and call.environment.world_size() > 1):
        return "ddp"
    if len(call.devices) == 1:
        return "single"
    return "ddp_fork" if call.interactive else "ddp"


def strategy_name(strategy: str) -> str:
    key = str(strategy).lower()
    if key in STRATEGIES or key == "auto":
        return key
    valid = ["auto", *STRATEGIES]
    if key in PLANNED:
        raise NotImplementedError(f"strategy {strategy!r} is not available in this version of easyfit yet. "
                                  f"Available: {', '.join(valid)}.")
    raise ValueError(f"unknown strategy {strategy!r}.{closest_name(key, valid + list(PLANNED))} "
                     f"Valid names: {', '.join(valid)}.")


def _check_conflicts(name: str, call: Call) -> None:
    if name in SPAWNING and call.external:
        raise ValueError(f"strategy={name!r} starts its own processes, but this one was already started by "
                         f"{call.environment.name} as one of several ranks. Use strategy='ddp' (or 'auto').")
    if name in ("ddp_fork", "ddp_notebook", "ddp_spawn") and call.num_nodes > 1:
        raise ValueError(f"strategy={name!r} starts processes on this machine only; for num_nodes > 1 start the "
                         "script on every node (torchrun, SLURM, or by hand with NODE_RANK) with strategy='ddp'")
    if name == "ddp" and call.interactive and not call.external and len(call.devices) > 1:
        raise ValueError("strategy='ddp' re-runs your script in each extra process, but this is a notebook or REPL. "
                         "Use strategy='ddp_notebook' (fork) here, or run the code as a script.")


def _node_devices(call: Call, devices) -> list[torch.device]:
    """Under an external launcher, devices='auto' means one device per process the launcher started on this node."""
    if not call.external or devices not in ("auto", None) or call.accelerator == "mps":
        return call.devices
    environment = call.environment
    per_node = environment.local_world_size() or max(environment.world_size() // call.num_nodes, 1)
    if call.accelerator == "cuda":
        return [torch.device("cuda", i) for i in range(min(per_node, torch.cuda.device_count()))]
    return [torch.device("cpu")] * per_node


def connect(strategy="auto", devices="auto", accelerator="auto", num_nodes: int = 1,
            process_group_backend: str | None = None) -> Strategy:
    """The Strategy for this call, configured for this process."""
    check_positive_int(num_nodes, "num_nodes")
    name = None if isinstance(strategy, Strategy) else strategy_name(strategy)  # a bad name is reported first
    resolved, parsed = parse_devices(devices, resolve_accelerator(accelerator))
    call = Call(resolved, parsed, num_nodes, detect_environment(), process_group_backend, is_interactive())
    if name == "auto":
        name = auto_strategy_name(call)
    chosen = name or strategy.name
    if chosen not in ("ddp2", "single"):   # those two use the devices asked for, not the launcher's processes
        call = replace(call, devices=_node_devices(call, devices))
    _check_conflicts(chosen, call)   # the chosen strategy's own conflicts first: their fix is the one that matters
    if name is not None:
        strategy = STRATEGIES[name](call)
    if chosen != "single":   # 'single' may run alone among a launcher's ranks (e.g. a rank-local evaluation)
        call.environment.validate(num_nodes, 1 if chosen == "ddp2" else len(call.devices))
    return _configure(strategy, call)


def _configure(strategy: Strategy, call: Call) -> Strategy:
    """Fill in what a strategy left unset (devices, nodes, environment, backend) from the call."""
    configure = getattr(strategy, "configure", None)
    if configure is not None:
        configure(accelerator=call.accelerator, parallel_devices=call.devices, num_nodes=call.num_nodes,
                  environment=call.environment, process_group_backend=call.process_group_backend)
    return strategy
