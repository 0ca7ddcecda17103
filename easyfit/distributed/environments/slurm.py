"""Tasks started by SLURM: ranks from its variables, the main address from its compressed node list."""
from __future__ import annotations

import os
import re

from easyfit.distributed.environments.base import ClusterEnvironment
from easyfit.utils.environment_variables import env_value, int_variable, required_variable

INTERACTIVE_SLURM_JOBS = ("bash", "interactive")


class SLURMEnvironment(ClusterEnvironment):
    """Tasks started by SLURM (srun, or sbatch with several tasks).

    The main address is MASTER_ADDR, else the first host of SLURM_JOB_NODELIST; the port is MASTER_PORT, else
    derived from SLURM_JOB_ID so every task of the job agrees on it without talking.
    """

    name = "SLURM"
    unit = "task"
    variables = {"world_size": "SLURM_NTASKS", "global_rank": "SLURM_PROCID", "local_rank": "SLURM_LOCALID",
                 "node_rank": "SLURM_NODEID"}

    @staticmethod
    def detect() -> bool:
        tasks = env_value("SLURM_NTASKS")
        interactive = os.environ.get("SLURM_JOB_NAME") in INTERACTIVE_SLURM_JOBS
        return tasks.isdigit() and int(tasks) > 1 and not interactive

    def local_world_size(self) -> int | None:
        nodes = env_value("SLURM_NNODES") or env_value("SLURM_JOB_NUM_NODES")
        if not nodes.isdigit() or int(nodes) == 0 or self.world_size() % int(nodes):
            return None
        return self.world_size() // int(nodes)

    @property
    def main_address(self) -> str:
        if env_value("MASTER_ADDR"):
            return env_value("MASTER_ADDR")
        nodelist = env_value("SLURM_JOB_NODELIST") or required_variable("SLURM_NODELIST", self.name)
        return expand_nodelist(nodelist)[0]

    @property
    def main_port(self) -> int:
        if env_value("MASTER_PORT"):
            return super().main_port
        return 10000 + int_variable("SLURM_JOB_ID", self.name) % 20000

    def launch_fix(self, num_nodes: int, devices_per_node: int) -> str:
        return f"set #SBATCH --nodes={num_nodes} and #SBATCH --ntasks-per-node={devices_per_node}"

    def missing_peers_hint(self, world_size: int) -> str:
        return (f"SLURM_NTASKS={world_size}, but the other tasks have not started: in a batch script, start the "
                "program with `srun python script.py` (sbatch alone runs one process).")


HOST_PATTERN = re.compile(r"(?:[^,\[\]]|\[[^\[\]]*\])+")
BRACKET = re.compile(r"([^\[]*)\[([^\]]*)\](.*)")
RANGE = re.compile(r"([0-9]+)(?:-([0-9]+))?")


def expand_nodelist(nodelist: str) -> list[str]:
    """SLURM's compressed host list -> host names: 'node[001-003,007],gpu5' -> node001 node002 node003 node007 gpu5."""
    hosts = [host for pattern in HOST_PATTERN.findall(nodelist) for host in _expand_host(pattern, nodelist)]
    if not hosts or ",".join(HOST_PATTERN.findall(nodelist)) != nodelist.strip():
        raise ValueError(f"cannot read the SLURM node list {nodelist!r}; set MASTER_ADDR to the first node's address.")
    return hosts


def _expand_host(pattern: str, nodelist: str) -> list[str]:
    """One host pattern, possibly with several bracket groups ('rack[1-2]-n[01-02]'), -> its hosts in order."""
    match = BRACKET.fullmatch(pattern)
    if match is None:
        return [pattern]
    prefix, ranges, rest = match.groups()
    tails = _expand_host(rest, nodelist)
    return [f"{prefix}{number}{tail}" for number in _numbers(ranges, nodelist) for tail in tails]


def _numbers(ranges: str, nodelist: str) -> list[str]:
    """'001-003,7' -> ['001', '002', '003', '7'], keeping each range's zero padding."""
    numbers = []
    for part in ranges.split(","):
        match = RANGE.fullmatch(part.strip())
        if match is None:
            raise ValueError(f"cannot read {part!r} in the SLURM node list {nodelist!r}; set MASTER_ADDR to the "
                             "first node's address.")
        start, end = match.group(1), match.group(2) or match.group(1)
        numbers += [str(number).zfill(len(start)) for number in range(int(start), int(end) + 1)]
    return numbers
