"""`easyfit.launch()`: start a script's ranks at its top, so every rank knows who it is before the first call."""
from __future__ import annotations

from easyfit.distributed.connector import connect
from easyfit.distributed.environments import record_launch_identity
from easyfit.distributed.fault_tolerance import set_default_max_restarts
from easyfit.distributed.run_options import Placement
from easyfit.utils.options import given, takes_options


@takes_options(Placement, strategy="ddp")
def launch(*, max_restarts: int = 0, devices="auto", accelerator="auto", strategy="ddp", num_nodes=1,
           auto_select_gpus=False, process_group_backend=None, **unknown):
    """Start the other ranks now, at the top of a script, instead of at the first fit / evaluate / predict call.

    The other ranks then import and load their data while this one does (the time to the first step comes close to
    torchrun's), and every rank knows its identity from here on (`model.global_rank`, `model.world_size`, e.g. to
    build a sampler or shard a data set by rank). The ranks meet in the process group at the first call (or in
    `strategy.module_construction()`, where a DeepSpeed stage 3 strategy partitions a net as it is built). Later
    calls use these ranks: call it with the devices and num_nodes your fit calls use. Under torchrun, SLURM or
    mpirun the launcher has started the ranks already, and this only reads who this process is. Returns the
    strategy, whose `global_rank` and `world_size` say who this process is. `max_restarts`: how often the fits
    of this script restart every rank after a failure (a fit's own `max_restarts` overrides it); a restarted fit
    continues from its fault-tolerance checkpoint (docs/fault-tolerance.md).
    """
    if not (type(max_restarts) is int and max_restarts >= 0):
        raise ValueError(f"max_restarts must be a non-negative integer, got {max_restarts!r}")
    [run] = given(locals(), Placement)
    chosen = connect(**run.placement())
    if chosen.capabilities.starts_processes:
        raise ValueError(f"easyfit.launch() starts the ranks of a script, but strategy={chosen.name!r} starts new "
                         "processes at each call. Use strategy='ddp' (the script is re-run for each rank), or "
                         "call fit directly.")
    launcher = chosen.make_launcher()
    if launcher is not None:
        launcher.start_early()
    record_launch_identity(chosen.global_rank, chosen.world_size)
    set_default_max_restarts(max_restarts)
    return chosen
