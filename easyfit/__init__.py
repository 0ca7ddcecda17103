"""easyfit: Keras-style fit / evaluate / predict for any torch.nn.Module, from one CPU to many GPUs."""
import os

from easyfit import callbacks, launchers, strategies
from easyfit.callbacks.history import History
from easyfit.distributed.launch import launch
from easyfit.model import Model

if os.environ.get("EASYFIT_EXCHANGE_DIR"):   # a re-run rank: its errors reach rank 0 from the very start
    from easyfit.distributed.launchers.script import report_errors_from_start
    report_errors_from_start()

__version__ = "0.1.0"
__all__ = ["Model", "History", "callbacks", "launch", "launchers", "strategies", "__version__"]
