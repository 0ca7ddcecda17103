"""The dispatcher: (strategy, devices, accelerator, num_nodes, launch environment) -> Strategy.

Precedence, top wins:
  1. A Strategy object beats a name; whatever it leaves unset is filled in from the call.
  2. What a launcher says (torchrun, SLURM, horovodrun/mpirun, the deepspeed launcher, or an easyfit-started rank)
     beats guessing: the processes exist already, so the world size is theirs, and devices="auto" adopts it. In
     rank 0 of a script whose ranks an earlier ddp call started, "auto" means those ranks too, so every rank
     resolves a call the same way.
  3. An explicit strategy name beats "auto".
  4. "auto": under a backend's own launcher (horovodrun, Bagua's) -> that backend; several nodes -> ddp; one
     device -> single; several devices in a script -> ddp, in a notebook or REPL -> ddp_fork (a notebook cannot
     re-run itself, and fork needs no pickling). A fit passes the estimated bytes of its training state
     (parameters, gradients, optimizer state): on several devices, when one replica would not fit a device's
     memory, "auto" picks fsdp instead of ddp / ddp_fork and the strategy's `auto_reason` says why.
Conflicts raise an error that says what to change.
"""
from __future__ import annotations

import copy

from easyfit.distributed import memory
from easyfit.distributed.calls import Call, configure_for_call, read_call
from easyfit.distributed.memory import TrainingMemory
from easyfit.distributed.run_options import RunOptions
from easyfit.distributed.strategies import registry
from easyfit.distributed.strategies.base import Strategy
from easyfit.utils.checks import closest_name


def auto_strategy_name(call: Call, training_memory: TrainingMemory | None = None) -> tuple[str, str | None]:
    """Rule 4 of the module docstring: (name, why a sharded strategy was picked or None)."""
    if call.accelerator == "tpu":
        return "xla", None
    if call.external and call.environment.native_strategy:
        return call.environment.native_strategy, None
    several = call.num_nodes > 1 or (call.external and call.environment.world_size() > 1)
    if not several and len(call.devices) == 1:
        return "single", None
    if training_memory is not None:
        processes = (call.external and call.environment.local_world_size()) or len(call.devices)
        available = memory.device_memory(call.accelerator, call.devices, processes)
        reason = memory.sharding_reason(training_memory, available)
        if reason is not None:
            return memory.SHARDED, reason
    return ("ddp_fork" if call.interactive and not several else "ddp"), None


def strategy_name(strategy: str | None) -> str:
    """The registered name a strategy= value means; None means 'auto'."""
    key = "auto" if strategy is None else str(strategy).lower()
    valid = ["auto", *registry.strategy_names()]
    if key in valid:
        return key
    raise ValueError(f"unknown strategy {strategy!r}.{closest_name(key, valid)} Valid names: {', '.join(valid)}.")


def _running_script_ranks(name: str, devices, num_nodes: int) -> tuple:
    """In rank 0 of a script whose ranks an earlier ddp call started, "auto" means those ranks, as it does in the
    re-run ranks themselves: every rank resolves the call the same way (e.g. evaluate() after fit(strategy="ddp"))."""
    from easyfit.distributed.launchers.script import running_script_world
    world = running_script_world()
    if world is None:
        return name, devices, num_nodes
    return "ddp", world[0], world[1]


def _xla_accelerator(name: str | None, strategy, accelerator: str) -> str:
    """The accelerator of a call whose strategy is or may be XLA: strategy="xla" runs on torch_xla's device
    ("tpu"); on TPUs only "xla" (or "auto", which picks it) can train. Checked before any backend is imported."""
    chosen = name or strategy.name
    asked = str(accelerator).lower()
    if chosen == "xla":
        if asked not in ("auto", "tpu"):
            raise ValueError(f"strategy='xla' trains on torch_xla's device (TPU, or the one PJRT_DEVICE names), not "
                             f"accelerator={accelerator!r}; pass accelerator='tpu' or 'auto'")
        return "tpu"
    if asked == "tpu" and chosen != "auto":
        raise ValueError(f"strategy={chosen!r} cannot run on TPUs: they train through torch_xla, with its own "
                         "collectives and compiled graphs, which only strategy='xla' drives. Use strategy='xla' or "
                         "'auto' with accelerator='tpu' (see docs/tpu.md).")
    return accelerator


def connect(strategy="auto", training_memory: TrainingMemory | None = None, ranks_elsewhere: bool = False,
            **placement) -> Strategy:
    """The Strategy for a call with these placement options (easyfit.distributed.run_options), configured for this
    process; `ranks_elsewhere`: the ranks are started elsewhere (Ray's workers), so a notebook's call is checked as
    a script's. The steps:
    1. parse the strategy name (a bad name is reported first), the accelerator and the devices;
    2. resolve "auto" (rule 4) and build the strategy from its row in the registry (or take the user's object);
    3. under a launcher, devices="auto" becomes one device per launched process, if the strategy takes them;
    4. conflicts: the strategy's own first (their fix is the one that matters), then the launcher's world;
    5. fill in what the strategy left unset."""
    run = RunOptions(strategy=strategy, **placement)
    devices, num_nodes = run.devices, run.num_nodes
    name = None if isinstance(strategy, Strategy) else strategy_name(strategy)
    if name == "auto" and devices in ("auto", None):   # rule 2: this script's re-run ranks are a launcher too
        name, devices, num_nodes = _running_script_ranks(name, devices, num_nodes)
    accelerator = _xla_accelerator(name, strategy, run.accelerator)
    call = read_call(run.replace(devices=devices, num_nodes=num_nodes, accelerator=accelerator),
                     interactive=False if ranks_elsewhere else None)
    reason = None
    if name == "auto":
        name, reason = auto_strategy_name(call, training_memory)
    if name is not None:
        strategy = registry.build(name, call)
        strategy.auto_reason = reason
    else:   # the user's own object stays as they made it: a second call configures it afresh
        strategy = copy.copy(strategy)
    return configure_for_call(strategy, call, devices)
