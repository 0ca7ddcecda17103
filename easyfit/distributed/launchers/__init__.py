"""How ranks come to exist and how they are watched, so that one failure stops them all; one module per launcher.

- `script.ScriptLauncher` ("ddp"): re-runs the user's script for the other local ranks; this process is rank 0.
- `spawn.ProcessLauncher` ("ddp_spawn", "ddp_fork", "ddp_notebook"): fresh or forked processes run the call;
  `fork_server` ends ddp_spawn's fork server with its caller.
- `lifetime`: no rank outlives its caller; SIGTERM lets a process clean up before it ends.
"""
from easyfit.distributed.launchers.base import Launcher
from easyfit.distributed.launchers.failures import RankFailedError
from easyfit.distributed.launchers.script import RelaunchedRankLauncher, ScriptLauncher, existing_rank_launcher
from easyfit.distributed.launchers.spawn import ProcessLauncher

__all__ = ["Launcher", "ProcessLauncher", "RankFailedError", "RelaunchedRankLauncher", "ScriptLauncher",
           "existing_rank_launcher"]
