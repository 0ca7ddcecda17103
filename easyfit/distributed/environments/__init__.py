"""Who started this process, and what that launcher says about ranks, world size and the main address.

Detection reads only `os.environ`, so it is cheap. `detect_environment()` checks, in this order:

1. a child started by easyfit's own launcher (`EASYFIT_LAUNCHED_RANK=1`)   -> LocalEnvironment, launched
2. Bagua's launcher (`BAGUA_SERVICE_PORT` + torch's rank variables)       -> BaguaEnvironment
3. torchrun / torch elastic (`TORCHELASTIC_RUN_ID`, or `GROUP_RANK` + ranks) -> TorchElasticEnvironment
4. the deepspeed launcher (`CROSS_RANK`, `CROSS_SIZE`: only it sets them)   -> DeepSpeedEnvironment
5. a Ray Train worker (a Ray worker with torch's rank variables)           -> RayEnvironment
6. mpirun / horovodrun (Open MPI `OMPI_COMM_WORLD_*`, horovodrun's `HOROVOD_*`,
   MPICH / Intel MPI `PMI_*` with `MPI_LOCAL*`)                             -> MPIEnvironment
7. SLURM running more than one task (`srun`, or `sbatch` with `--ntasks` > 1),
   outside an interactive allocation                                       -> SLURMEnvironment
8. anything else: a plain `python script.py`; easyfit starts the others     -> LocalEnvironment

The launcher that started this very process comes first: launchers run inside others (torchrun, deepspeed, mpirun or
horovodrun inside a SLURM job) and the outer one's variables are still there but describe the wrong processes.
A one-task SLURM job (`#SBATCH --ntasks=1 --gres=gpu:4`) is left to easyfit's own launcher, so `devices=4` works there.
"""
from __future__ import annotations

import os
import random
import socket
from pathlib import Path

from easyfit.distributed.environments.base import ClusterEnvironment
from easyfit.distributed.environments.ray_train import RayEnvironment
from easyfit.distributed.environments.slurm import SLURMEnvironment
from easyfit.utils.environment_variables import all_set, env_value

LAUNCHED_RANK_VARIABLE = "EASYFIT_LAUNCHED_RANK"
#: the attempt of a fit that easyfit's launcher restarts (`max_restarts`), as it tells every rank
RESTART_COUNT_VARIABLE = "EASYFIT_RESTART_COUNT"
#: the working directory when easyfit was imported: re-run ranks start there even if the script changed it since
START_DIRECTORY = os.getcwd()
#: the MASTER_PORT this process was started with (None: easyfit chooses the ports of the ranks it starts)
GIVEN_PORT = os.environ.get("MASTER_PORT")
DEFAULT_PORT = 29500
#: ports easyfit chooses for the ranks it starts lie from here (above Ray's worker ports) to the outgoing range
FIRST_CHOSEN_PORT = 20000
PORT_DRAWS = 64
OUTGOING_PORTS_FILE = "/proc/sys/net/ipv4/ip_local_port_range"
RANKS = ("world_size", "global_rank", "local_rank")
TORCH_RANKS = {"world_size": "WORLD_SIZE", "global_rank": "RANK", "local_rank": "LOCAL_RANK"}


def find_free_port() -> int:
    """A TCP port that is free on this machine now, drawn below the range the system hands to outgoing connections:
    between this choice and the moment a rank binds the port, no connection opened meanwhile (a data loader, a Ray
    worker, another run's ranks) can take it. The draw leaves the user's `random` state alone."""
    draw, end = random.SystemRandom(), outgoing_ports_start()
    for _ in range(PORT_DRAWS if end > FIRST_CHOSEN_PORT else 0):
        port = draw.randrange(FIRST_CHOSEN_PORT, end)
        if port_is_free(port):
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:   # no room below, or every draw taken
        sock.bind(("", 0))
        return sock.getsockname()[1]


def outgoing_ports_start() -> int:
    """The first port the system may give an outgoing connection (Linux says; elsewhere the common default)."""
    try:
        return int(Path(OUTGOING_PORTS_FILE).read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def port_is_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("", port))
        except OSError:
            return False
        return True


class LocalEnvironment(ClusterEnvironment):
    """A plain `python script.py`: this process launches the others and tells this object the world it made.

    In a child started by easyfit's own launcher (`EASYFIT_LAUNCHED_RANK=1`) the processes already exist and
    the ranks come from WORLD_SIZE, RANK, LOCAL_RANK, NODE_RANK and LOCAL_WORLD_SIZE. To run on several machines
    without a launcher, start the script by hand on each with the same MASTER_ADDR and MASTER_PORT and its NODE_RANK.
    """

    variables = {**TORCH_RANKS, "node_rank": "NODE_RANK", "local_world_size": "LOCAL_WORLD_SIZE"}

    def __init__(self) -> None:
        self._port: int | None = None
        self._world: tuple[int, int, int] | None = None
        # read once: easyfit's launcher sets the variable when it starts the child, never later
        self.creates_processes_externally = self.launched_by_easyfit = self.detect()
        self.name = "easyfit's launcher" if self.creates_processes_externally else "local"

    @staticmethod
    def detect() -> bool:
        """True in a child started by easyfit's own launcher; a plain run is what remains when nothing is detected."""
        return env_value(LAUNCHED_RANK_VARIABLE) == "1"

    @property
    def main_address(self) -> str:
        return env_value("MASTER_ADDR") or "127.0.0.1"

    @property
    def main_port(self) -> int:
        if env_value("MASTER_PORT"):
            return super().main_port
        if self._port is None:
            self._port = find_free_port()
        return self._port

    def set_world(self, world_size: int, global_rank: int, local_rank: int) -> None:
        """The launching process records the world it creates (a launched child reads it from its variables)."""
        if world_size < 1 or not 0 <= global_rank < world_size or local_rank < 0:
            raise ValueError(f"set_world({world_size}, {global_rank}, {local_rank}): need world_size >= 1, "
                             "0 <= global_rank < world_size and local_rank >= 0.")
        self._world = (world_size, global_rank, local_rank)

    def world_size(self) -> int:
        return self._given("world_size", 1)

    def global_rank(self) -> int:
        return self._given("global_rank", 0)

    def local_rank(self) -> int:
        return self._given("local_rank", 0)

    def _given(self, role: str, default: int) -> int:
        if self._world is not None:
            return self._world[RANKS.index(role)]
        return self._read(role) if self.creates_processes_externally else default

    def node_rank(self) -> int:
        return self._read("node_rank") if env_value("NODE_RANK") else 0

    def local_world_size(self) -> int | None:
        return super().local_world_size() if self.creates_processes_externally else None

    def validate(self, num_nodes: int, devices_per_node: int) -> None:
        """A launched child checks its world; a plain run on several nodes needs the variables that join them."""
        if self.creates_processes_externally or num_nodes == 1:
            super().validate(num_nodes, devices_per_node)
            return
        missing = [name for name in ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK") if not env_value(name)]
        if missing:
            raise ValueError(
                f"num_nodes={num_nodes} needs a launcher (torchrun, SLURM, mpirun) or the script started by hand on "
                f"each node with MASTER_ADDR, MASTER_PORT and NODE_RANK set; {', '.join(missing)} not set. E.g. "
                f"MASTER_ADDR=<first node's address> MASTER_PORT={DEFAULT_PORT} NODE_RANK=<0..{num_nodes - 1}> "
                "python script.py on each node.")
        if not 0 <= self.node_rank() < num_nodes:
            raise ValueError(f"NODE_RANK={self.node_rank()} but num_nodes={num_nodes}: give each node a NODE_RANK "
                             f"from 0 to {num_nodes - 1}.")

    def launch_fix(self, num_nodes: int, devices_per_node: int) -> str:
        return "every process must call fit with the same devices= and num_nodes="

    def missing_peers_hint(self, world_size: int) -> str:
        return ("With several nodes, start the script on every node with the same MASTER_ADDR and MASTER_PORT and "
                "its own NODE_RANK.")


class TorchElasticEnvironment(ClusterEnvironment):
    """Processes started by torchrun (torch.distributed.run, torch elastic)."""

    name = "torchrun"
    variables = {**TORCH_RANKS, "node_rank": "GROUP_RANK", "local_world_size": "LOCAL_WORLD_SIZE"}

    @staticmethod
    def detect() -> bool:
        return "TORCHELASTIC_RUN_ID" in os.environ or all_set(("GROUP_RANK", *TORCH_RANKS.values()))

    def launch_fix(self, num_nodes: int, devices_per_node: int) -> str:
        return f"run torchrun --nnodes={num_nodes} --nproc-per-node={devices_per_node} on each node"


class BaguaEnvironment(ClusterEnvironment):
    """Processes started by Bagua's launcher (`python -m bagua.distributed.launch`, `baguarun`): torch's rank
    variables plus BAGUA_SERVICE_PORT."""

    name = "the bagua launcher"
    native_strategy = "bagua"
    variables = {**TORCH_RANKS, "node_rank": "NODE_RANK", "local_world_size": "LOCAL_WORLD_SIZE"}

    @staticmethod
    def detect() -> bool:
        return all_set(("BAGUA_SERVICE_PORT", *TORCH_RANKS.values()))

    def launch_fix(self, num_nodes: int, devices_per_node: int) -> str:
        return (f"run python -m bagua.distributed.launch --nnodes={num_nodes} --nproc_per_node={devices_per_node} "
                "on each node")


class DeepSpeedEnvironment(ClusterEnvironment):
    """Processes started by the `deepspeed` launcher: the usual ranks plus CROSS_RANK, CROSS_SIZE and LOCAL_SIZE."""

    name = "the deepspeed launcher"
    variables = {**TORCH_RANKS, "node_rank": "CROSS_RANK", "local_world_size": "LOCAL_SIZE"}

    @staticmethod
    def detect() -> bool:
        return all_set(("CROSS_RANK", "CROSS_SIZE", "LOCAL_SIZE", "RANK"))

    def launch_fix(self, num_nodes: int, devices_per_node: int) -> str:
        return f"run deepspeed --num_nodes={num_nodes} --num_gpus={devices_per_node}"


MPI_FLAVOURS = (
    {"world_size": "OMPI_COMM_WORLD_SIZE", "global_rank": "OMPI_COMM_WORLD_RANK",
     "local_rank": "OMPI_COMM_WORLD_LOCAL_RANK", "local_world_size": "OMPI_COMM_WORLD_LOCAL_SIZE"},
    {"world_size": "HOROVOD_SIZE", "global_rank": "HOROVOD_RANK",
     "local_rank": "HOROVOD_LOCAL_RANK", "local_world_size": "HOROVOD_LOCAL_SIZE"},
    {"world_size": "PMI_SIZE", "global_rank": "PMI_RANK",
     "local_rank": "MPI_LOCALRANKID", "local_world_size": "MPI_LOCALNRANKS"},
)


def _mpi_variables() -> dict[str, str] | None:
    """The variable names of the MPI flavour (Open MPI, horovodrun, MPICH) that started this process, if any."""
    return next((flavour for flavour in MPI_FLAVOURS if all_set(flavour.values())), None)


class MPIEnvironment(ClusterEnvironment):
    """Processes started by mpirun (Open MPI, MPICH, Intel MPI) or horovodrun.

    MPI does not say where rank 0 runs: the main address is MASTER_ADDR, else horovodrun's rendezvous host,
    else 127.0.0.1 when every rank is on this node. The port is MASTER_PORT, else 29500.
    """

    name = "MPI"

    def __init__(self) -> None:
        flavour = _mpi_variables()
        if flavour is None:
            raise RuntimeError("MPIEnvironment needs the rank variables of mpirun or horovodrun; none are set.")
        self.variables = dict(flavour)

    @staticmethod
    def detect() -> bool:
        return _mpi_variables() is not None

    @property
    def native_strategy(self) -> str | None:
        """horovodrun (Gloo) sets HOROVOD_RANK: its ranks run Horovod. Under plain mpirun pass strategy='horovod'."""
        return "horovod" if self.variables["global_rank"] == "HOROVOD_RANK" else None

    def node_rank(self) -> int:
        return self.global_rank() // self.local_world_size()

    @property
    def main_address(self) -> str:
        address = env_value("MASTER_ADDR") or env_value("HOROVOD_GLOO_RENDEZVOUS_ADDR")
        if address:
            return address
        if self.world_size() == self.local_world_size():
            return "127.0.0.1"
        raise RuntimeError("MPI started processes on several nodes but does not say where rank 0 runs: pass "
                           "MASTER_ADDR (the first node's address) and MASTER_PORT to every rank, e.g. "
                           f"mpirun -x MASTER_ADDR=$(hostname) -x MASTER_PORT={DEFAULT_PORT} ...")

    @property
    def main_port(self) -> int:
        return super().main_port if env_value("MASTER_PORT") else DEFAULT_PORT

    def launch_fix(self, num_nodes: int, devices_per_node: int) -> str:
        total = num_nodes * devices_per_node
        return (f"start {total} processes, {devices_per_node} per node (mpirun -np {total} --npernode "
                f"{devices_per_node} ..., or horovodrun -np {total} -H host1:{devices_per_node},...)")


ENVIRONMENTS = (LocalEnvironment, BaguaEnvironment, TorchElasticEnvironment, DeepSpeedEnvironment, RayEnvironment,
                MPIEnvironment, SLURMEnvironment)


def detect_environment() -> ClusterEnvironment:
    """The environment of the launcher that started this process (precedence in the module docstring)."""
    for environment in ENVIRONMENTS:
        if environment.detect():
            return environment()
    return LocalEnvironment()


_early_identity: tuple[int, int] | None = None


def record_launch_identity(global_rank: int, world_size: int) -> None:
    """What `easyfit.launch()` established: this process's identity from then on."""
    global _early_identity
    _early_identity = (global_rank, world_size)


def launch_identity() -> tuple[int, int]:
    """(global rank, world size) of this process: as `easyfit.launch()` or its launcher says, or (0, 1) for a plain
    run whose ranks are not started yet."""
    if _early_identity is not None:
        return _early_identity
    environment = detect_environment()
    if environment.creates_processes_externally:
        return environment.global_rank(), environment.world_size()
    return 0, 1
