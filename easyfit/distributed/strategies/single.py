"""One process, one device."""
from easyfit.distributed.strategies.base import Strategy


class SingleDeviceStrategy(Strategy):
    """Training on one device in this process: the base contract as it is."""

    name = "single"
