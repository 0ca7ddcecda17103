"""Who started this process, and what that launcher says about ranks, world size and the main address.

Detection reads only `os.environ`, so it is cheap. `detect_environment()` checks, in this order:

1. a child started by easyfit's own launcher (`EASYFIT_LAUNCHED_RANK=1`)   -> LocalEnvironment, launched
2. Bagua's launcher (`BAGUA_SERVICE_PORT` + torch's rank variables)       -> BaguaEnvironment
3. torchrun / torch elastic (`TORCHELASTIC_RUN_ID`, or `GROUP_RANK` + ranks) -> TorchElasticEnvironment
4. the deepspeed launcher (`CROSS_RANK`, `CROSS_SIZE`: only it sets them)   -> DeepSpeedEnvironment
5. mpirun / horovodrun (Open MPI `OMPI_COMM_WORLD_*`, horovodrun's `HOROVOD_*`,
   MPICH / Intel MPI `PMI_*` with `MPI_LOCAL*`)                             -> MPIEnvironment
6. SLURM running more than one task (`srun`, or `sbatch` with `--ntasks` > 1),
   outside an interactive allocation                                       -> SLURMEnvironment
7. anything else: a plain `python script.py`; easyfit starts the others     -> LocalEnvironment

The launcher that started this very process comes first: launchers run inside others (torchrun, deepspeed, mpirun or
horovodrun inside a SLURM job) and the outer one's variables are still there but describe the wrong processes.
A one-task SLURM job (`#SBATCH --ntasks=1 --gres=gpu:4`) is left to easyfit's own launcher, so `devices=4` works there.
"""
from __future__ import annotations

import os
import re
import socket

LAUNCHED_RANK_VARIABLE = "EASYFIT_LAUNCHED_RANK"
#: the attempt of a fit that easyfit's launcher restarts (`max_restarts`), as it tells every rank
RESTART_COUNT_VARIABLE = "EASYFIT_RESTART_COUNT"
#: the working directory when easyfit was imported: re-run ranks start there even if the script changed it since
START_DIRECTORY = os.getcwd()
#: the MASTER_PORT this process was started with (None: easyfit chooses the ports of the ranks it starts)
GIVEN_PORT = os.environ.get("MASTER_PORT")
DEFAULT_PORT = 29500
INTERACTIVE_SLURM_JOBS = ("bash", "interactive")
RANKS = ("world_size", "global_rank", "local_rank")
TORCH_RANKS = {"world_size": "WORLD_SIZE", "global_rank": "RANK", "local_rank": "LOCAL_RANK"}


def _env(name: str) -> str:
    """The variable's value without surrounding blanks; '' when unset."""
    return os.environ.get(name, "").strip()


def _all_set(names) -> bool:
    return all(name in os.environ for name in names)


def _variable(name: str, launcher: str) -> str:
    value = _env(name)
    if not value:
        raise RuntimeError(f"{launcher} started this process but the environment variable {name} is not set; "
                           f"start the script with {launcher} as documented, or set {name} yourself.")
    return value


def _int_variable(name: str, launcher: str) -> int:
    value = _variable(name, launcher)
    try:
        return int(value)
    except ValueError:
        raise RuntimeError(f"the environment variable {name}={value!r} should be an integer.") from None


def _plural(count: int, unit: str) -> str:
    return f"{count} {unit}" + ("" if count == 1 else "es" if unit.endswith("s") else "s")


class ClusterEnvironment:
    """What the launcher of this process says about the world it belongs to.

    Subclasses name their launcher, say how to detect it, and map the roles world_size, global_rank, local_rank,
    node_rank and local_world_size (processes per node) to the variables it sets.
    """

    name = "the launcher"
    unit = "process"
    creates_processes_externally = True
    #: this process is a copy of the user's script that easyfit's own launcher started
    launched_by_easyfit = False
    #: the strategy strategy="auto" picks under this launcher, when the launcher belongs to one backend
    native_strategy: str | None = None
    variables: dict[str, str] = {}

    @staticmethod
    def detect() -> bool:
        """True when this launcher started the current process (read from os.environ)."""
        raise NotImplementedError

    @property
    def main_address(self) -> str:
        """Host of global rank 0, where the process group meets."""
        return _variable("MASTER_ADDR", self.name)

    @property
    def main_port(self) -> int:
        """Port on the main address where the process group meets."""
        return _int_variable("MASTER_PORT", self.name)

    def world_size(self) -> int:
        return self._read("world_size")

    def global_rank(self) -> int:
        return self._read("global_rank")

    def local_rank(self) -> int:
        return self._read("local_rank")

    def node_rank(self) -> int:
        return self._read("node_rank")

    def local_world_size(self) -> int | None:
        """Processes per node, or None when the launcher does not say."""
        return self._read("local_world_size") if "local_world_size" in self.variables else None

    def _read(self, role: str) -> int:
        return _int_variable(self.variables[role], self.name)

    def validate(self, num_nodes: int, devices_per_node: int) -> None:
        """Raise ValueError, with the fix, when the launcher's world is not num_nodes × devices_per_node processes."""
        if not self.creates_processes_externally:
            return
        world, local = self.world_size(), self.local_world_size()
        expected = num_nodes * devices_per_node
        if world == expected and local in (None, devices_per_node):
            return
        per_node = f" ({local} per node)" if local is not None else ""
        raise ValueError(f"{self.name} started {_plural(world, self.unit)}{per_node} but fit asks for "
                         f"num_nodes={num_nodes} × devices={devices_per_node} = {expected} processes; "
                         f"{self.launch_fix(num_nodes, devices_per_node)}{_fit_fix(num_nodes, world, local)}.")

    def launch_fix(self, num_nodes: int, devices_per_node: int) -> str:
        """How to start this launcher so that it runs num_nodes × devices_per_node processes."""
        raise NotImplementedError

    def missing_peers_hint(self, world_size: int) -> str:
        """The likely reason why peers have not joined the process group yet."""
        return (f"{self.name} says the run has {world_size} processes: check that all of them were started, and "
                "that every one reaches the same fit / evaluate / predict call.")


def _fit_fix(num_nodes: int, world: int, local: int | None) -> str:
    """', or pass devices=... to fit' matching what the launcher started, when that can be said."""
    if local and world % local == 0:
        nodes, per_node = world // local, local
    elif world % num_nodes == 0:
        nodes, per_node = num_nodes, world // num_nodes
    else:
        return ""
    arguments = f"devices={per_node}" if nodes == num_nodes else f"num_nodes={nodes}, devices={per_node}"
    return f", or pass {arguments} to fit"


def find_free_port() -> int:
    """A TCP port that is free on this machine right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


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

    @staticmethod
    def detect() -> bool:
        """True in a child started by easyfit's own launcher; a plain run is what remains when nothing is detected."""
        return _env(LAUNCHED_RANK_VARIABLE) == "1"

    @property
    def name(self) -> str:
        return "easyfit's launcher" if self.creates_processes_externally else "local"

    @property
    def creates_processes_externally(self) -> bool:
        return self.detect()

    @property
    def launched_by_easyfit(self) -> bool:
        return self.detect()

    @property
    def main_address(self) -> str:
        return _env("MASTER_ADDR") or "127.0.0.1"

    @property
    def main_port(self) -> int:
        if _env("MASTER_PORT"):
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
        return self._read("node_rank") if _env("NODE_RANK") else 0

    def local_world_size(self) -> int | None:
        return super().local_world_size() if self.creates_processes_externally else None

    def validate(self, num_nodes: int, devices_per_node: int) -> None:
        """A launched child checks its world; a plain run on several nodes needs the variables that join them."""
        if self.creates_processes_externally or num_nodes == 1:
            super().validate(num_nodes, devices_per_node)
            return
        missing = [name for name in ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK") if not _env(name)]
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
        return "TORCHELASTIC_RUN_ID" in os.environ or _all_set(("GROUP_RANK", *TORCH_RANKS.values()))

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
        return _all_set(("BAGUA_SERVICE_PORT", *TORCH_RANKS.values()))

    def launch_fix(self, num_nodes: int, devices_per_node: int) -> str:
        return (f"run python -m bagua.distributed.launch --nnodes={num_nodes} --nproc_per_node={devices_per_node} "
                "on each node")


class DeepSpeedEnvironment(ClusterEnvironment):
    """Processes started by the `deepspeed` launcher: the usual ranks plus CROSS_RANK, CROSS_SIZE and LOCAL_SIZE."""

    name = "the deepspeed launcher"
    variables = {**TORCH_RANKS, "node_rank": "CROSS_RANK", "local_world_size": "LOCAL_SIZE"}

    @staticmethod
    def detect() -> bool:
        return _all_set(("CROSS_RANK", "CROSS_SIZE", "LOCAL_SIZE", "RANK"))

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
    return next((flavour for flavour in MPI_FLAVOURS if _all_set(flavour.values())), None)


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
        address = _env("MASTER_ADDR") or _env("HOROVOD_GLOO_RENDEZVOUS_ADDR")
        if address:
            return address
        if self.world_size() == self.local_world_size():
            return "127.0.0.1"
        raise RuntimeError("MPI started processes on several nodes but does not say where rank 0 runs: pass "
                           "MASTER_ADDR (the first node's address) and MASTER_PORT to every rank, e.g. "
                           f"mpirun -x MASTER_ADDR=$(hostname) -x MASTER_PORT={DEFAULT_PORT} ...")

    @property
    def main_port(self) -> int:
        return super().main_port if _env("MASTER_PORT") else DEFAULT_PORT

    def launch_fix(self, num_nodes: int, devices_per_node: int) -> str:
        total = num_nodes * devices_per_node
        return (f"start {total} processes, {devices_per_node} per node (mpirun -np {total} --npernode "
                f"{devices_per_node} ..., or horovodrun -np {total} -H host1:{devices_per_node},...)")


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
        tasks = _env("SLURM_NTASKS")
        interactive = os.environ.get("SLURM_JOB_NAME") in INTERACTIVE_SLURM_JOBS
        return tasks.isdigit() and int(tasks) > 1 and not interactive

    def local_world_size(self) -> int | None:
        nodes = _env("SLURM_NNODES") or _env("SLURM_JOB_NUM_NODES")
        if not nodes.isdigit() or int(nodes) == 0 or self.world_size() % int(nodes):
            return None
        return self.world_size() // int(nodes)

    @property
    def main_address(self) -> str:
        if _env("MASTER_ADDR"):
            return _env("MASTER_ADDR")
        nodelist = _env("SLURM_JOB_NODELIST") or _variable("SLURM_NODELIST", self.name)
        return expand_nodelist(nodelist)[0]

    @property
    def main_port(self) -> int:
        if _env("MASTER_PORT"):
            return super().main_port
        return 10000 + _int_variable("SLURM_JOB_ID", self.name) % 20000

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


ENVIRONMENTS = (LocalEnvironment, BaguaEnvironment, TorchElasticEnvironment, DeepSpeedEnvironment, MPIEnvironment,
                SLURMEnvironment)


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
