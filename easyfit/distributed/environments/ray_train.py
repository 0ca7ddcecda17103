"""Ray Train's workers: a `TorchTrainer`'s `train_loop_per_worker` (the user's own, or the one `launcher="ray"`
runs) is one rank of a process group Ray has made already, with torch's rank variables set."""
from __future__ import annotations

import os

from easyfit.distributed.environments.base import ClusterEnvironment
from easyfit.utils.environment_variables import all_set

#: set in the workers of a Ray Train run that easyfit's `launcher="ray"` started (its restarts are easyfit's too)
RAY_LAUNCHED_VARIABLE = "EASYFIT_RAY_LAUNCHED"
#: what Ray Train's torch backend sets in each worker, besides MASTER_ADDR / MASTER_PORT
RAY_TRAIN_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "NODE_RANK")


class RayEnvironment(ClusterEnvironment):
    """A Ray Train worker: a Ray worker process (RAY_RAYLET_PID) with torch's rank variables, whose process group
    Ray has made; a fit there joins it, as under torchrun."""

    name = "Ray Train"
    unit = "worker"
    variables = {"world_size": "WORLD_SIZE", "global_rank": "RANK", "local_rank": "LOCAL_RANK",
                 "node_rank": "NODE_RANK", "local_world_size": "LOCAL_WORLD_SIZE"}

    @staticmethod
    def detect() -> bool:
        return "RAY_RAYLET_PID" in os.environ and all_set(RAY_TRAIN_VARIABLES)

    @property
    def launched_by_easyfit(self) -> bool:
        return os.environ.get(RAY_LAUNCHED_VARIABLE) == "1"

    def validate(self, num_nodes: int, devices_per_node: int) -> None:
        """A user's own TorchTrainer must have started the workers the call asks for; launcher="ray" made its run
        for the call, and Ray placed its workers over the nodes as they fit (some nodes may hold more)."""
        if not self.launched_by_easyfit:
            super().validate(num_nodes, devices_per_node)

    def launch_fix(self, num_nodes: int, devices_per_node: int) -> str:
        return (f"give the TorchTrainer ScalingConfig(num_workers={num_nodes * devices_per_node}), or launcher='ray' "
                "the same devices and num_nodes")
