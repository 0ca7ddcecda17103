"""`easyfit.devices`: the public path of the device choice (the code lives in easyfit.distributed.devices)."""
from easyfit.distributed.devices import find_usable_cuda_devices

__all__ = ["find_usable_cuda_devices"]
