"""One process, one device."""
from easyfit.distributed.strategies.base import Strategy
from easyfit.distributed.strategies.capabilities import Capabilities


class SingleDeviceStrategy(Strategy):
    """Training on one device in this process: the base contract as it is. Among a launcher's ranks it runs on this
    rank alone (rank-local work), so it is not checked against the launcher's processes."""

    name = "single"
    capabilities = Capabilities(uses_launcher_processes=False, supports_compile=True)

    def check_call(self, call) -> None:
        if len(call.devices) > 1 or call.num_nodes > 1:
            raise ValueError(f"strategy='single' runs one process on one device, but this call asks for "
                             f"{len(call.devices)} device(s) × {call.num_nodes} node(s). Use strategy='ddp' or "
                             "'auto', or devices=1 and num_nodes=1.")

    def processes_per_node(self, call) -> None:
        return None
