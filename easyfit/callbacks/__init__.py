"""Callbacks with Keras' names and hooks. Subclass `Callback` for your own."""
from easyfit.callbacks.base import Callback, CallbackList
from easyfit.callbacks.history import History
from easyfit.callbacks.progress import EpochSummary, ProgressBar

__all__ = ["Callback", "CallbackList", "History", "ProgressBar", "EpochSummary"]
