"""What a fit / evaluate / predict call asked for (`Call`), and configuring a strategy for it: the devices of this
node, the conflicts between the strategy, the call and the launcher, and the settings the strategy left unset.
The connector picks the strategy; this module is what it shares with code that configures a strategy it was given
(a net built sharded before any fit)."""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from easyfit.distributed.devices import is_interactive, parse_devices, resolve_accelerator
from easyfit.distributed.environments import ClusterEnvironment, detect_environment
from easyfit.distributed.run_options import RunOptions
from easyfit.distributed.strategies.base import Strategy


@dataclass(frozen=True)
class Call:
    """What a fit / evaluate / predict call asked for, after parsing."""
    accelerator: str
    devices: list[torch.device]
    num_nodes: int
    environment: ClusterEnvironment
    process_group_backend: str | None
    interactive: bool
    auto_selected: bool = False   # the devices are the usable GPUs auto_select_gpus found

    @property
    def external(self) -> bool:
        return self.environment.creates_processes_externally


def read_call(run: RunOptions | None = None, interactive: bool | None = None) -> Call:
    """Parse the accelerator and devices of a call's run options, and detect who started this process;
    `interactive`: None: whether this is a notebook or REPL."""
    run = run or RunOptions()
    devices = run.devices
    auto_select = run.auto_select_gpus or (isinstance(devices, str) and devices.strip().lower() == "auto_select")
    resolved, parsed = parse_devices(devices, resolve_accelerator(run.accelerator), auto_select=auto_select)
    return Call(resolved, parsed, run.num_nodes, detect_environment(), run.process_group_backend,
                is_interactive() if interactive is None else interactive, auto_select)


def configure_for_call(strategy: Strategy, call: Call, devices="auto") -> Strategy:
    """Steps 3-5 of `connect`: the devices of this node under a launcher (for `devices` as the user gave them), the
    conflicts, then what the strategy left unset, filled in from the call."""
    if call.auto_selected:
        strategy.selection_note = f"auto-selected CUDA devices {', '.join(str(d.index) for d in call.devices)}"
    if strategy.capabilities.uses_launcher_processes:
        call = replace(call, devices=_node_devices(call, devices))
    _check_conflicts(strategy, call)
    per_node = strategy.processes_per_node(call)
    if per_node is not None:   # e.g. 'single' may run alone among a launcher's ranks (a rank-local evaluation)
        call.environment.validate(call.num_nodes, per_node)
    strategy.configure(accelerator=call.accelerator, parallel_devices=call.devices, num_nodes=call.num_nodes,
                       environment=call.environment, process_group_backend=call.process_group_backend)
    return strategy


def _check_conflicts(strategy: Strategy, call: Call) -> None:
    """What no strategy that starts its own processes can do, then the strategy's own conflicts."""
    name = strategy.name
    if strategy.capabilities.starts_processes and call.external:
        raise ValueError(f"strategy={name!r} starts its own processes, but this one was already started by "
                         f"{call.environment.name} as one of several ranks. Use strategy='ddp' (or 'auto').")
    if strategy.capabilities.starts_processes and call.num_nodes > 1:
        raise ValueError(f"strategy={name!r} starts processes on this machine only; for num_nodes > 1 start the "
                         "script on every node (torchrun, SLURM, or by hand with NODE_RANK) with strategy='ddp'")
    strategy.check_call(call)


def _node_devices(call: Call, devices) -> list[torch.device]:
    """Under an external launcher, devices='auto' means one device per process the launcher started on this node."""
    if not call.external or devices not in ("auto", None) or call.accelerator == "mps":
        return call.devices
    environment = call.environment
    per_node = environment.local_world_size() or max(environment.world_size() // call.num_nodes, 1)
    if call.accelerator == "cuda":
        return [torch.device("cuda", i) for i in range(min(per_node, torch.cuda.device_count()))]
    return [torch.device("cpu")] * per_node
