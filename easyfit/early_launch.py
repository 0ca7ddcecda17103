"""`easyfit.launch()`: start a script's ranks and join the process group before the first fit."""
from __future__ import annotations

from easyfit.distributed.connector import connect
from easyfit.distributed.environments import record_launch_identity


def launch(devices="auto", accelerator: str = "auto", strategy="ddp", num_nodes: int = 1,
           process_group_backend: str | None = None):
    """Start the ranks now, at the top of a script, instead of at the first fit / evaluate / predict call.

    Every rank then knows its identity from here on (`model.global_rank`, `model.world_size`, e.g. to build a
    sampler or shard a data set), the other ranks start while this one is still loading data, and the process
    group exists before the net is built (sharded construction). Later calls use the same ranks: call it with the
    devices and num_nodes your fit calls use. Returns the strategy, whose `global_rank` and `world_size` say who
    this process is. Under torchrun, SLURM or mpirun it joins the ranks the launcher started.
    """
    chosen = connect(strategy=strategy, devices=devices, accelerator=accelerator, num_nodes=num_nodes,
                     process_group_backend=process_group_backend)
    if chosen.starts_processes:
        raise ValueError(f"easyfit.launch() starts the ranks of a script, but strategy={chosen.name!r} starts new "
                         "processes at each call. Use strategy='ddp' (the script is re-run for each rank), or "
                         "call fit directly.")
    launcher = chosen.launcher
    if launcher is None:
        chosen.setup_environment()
    else:
        launcher.launch(chosen.setup_environment)
    record_launch_identity(chosen.global_rank, chosen.world_size)
    return chosen
