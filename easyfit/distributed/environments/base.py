"""The base of every launch environment: what a launcher says about ranks, world size and the main address, read
from the variables it sets, and the checks against what a call asks for."""
from __future__ import annotations

from easyfit.utils.environment_variables import int_variable, required_variable


def plural(count: int, unit: str) -> str:
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
        return required_variable("MASTER_ADDR", self.name)

    @property
    def main_port(self) -> int:
        """Port on the main address where the process group meets."""
        return int_variable("MASTER_PORT", self.name)

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
        return int_variable(self.variables[role], self.name)

    def validate(self, num_nodes: int, devices_per_node: int) -> None:
        """Raise ValueError, with the fix, when the launcher's world is not num_nodes × devices_per_node processes."""
        if not self.creates_processes_externally:
            return
        world, local = self.world_size(), self.local_world_size()
        expected = num_nodes * devices_per_node
        if world == expected and local in (None, devices_per_node):
            return
        per_node = f" ({local} per node)" if local is not None else ""
        raise ValueError(f"{self.name} started {plural(world, self.unit)}{per_node} but fit asks for "
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
