"""easyfit: Keras-style fit / evaluate / predict for any torch.nn.Module, from one CPU to many GPUs."""
from easyfit import callbacks, strategies
from easyfit.callbacks.history import History
from easyfit.model import Model

__version__ = "0.1.0"
__all__ = ["Model", "History", "callbacks", "strategies", "__version__"]
