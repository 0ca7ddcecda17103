"""Callbacks with Keras' names and hooks, and those around the fit (tracking, weight averaging, pruning,
throughput, profiling), whose libraries are imported only when used. Subclass `Callback` for your own."""
import importlib

from easyfit.callbacks.backup_and_restore import BackupAndRestore
from easyfit.callbacks.base import Callback, CallbackList
from easyfit.callbacks.csv_logger import CSVLogger
from easyfit.callbacks.early_stopping import EarlyStopping
from easyfit.callbacks.history import History
from easyfit.callbacks.lambda_callback import LambdaCallback
from easyfit.callbacks.lr_scheduler import LearningRateScheduler
from easyfit.callbacks.model_checkpoint import ModelCheckpoint
from easyfit.callbacks.progress import EpochSummary, ProgressBar
from easyfit.callbacks.reduce_lr_on_plateau import ReduceLROnPlateau
from easyfit.callbacks.tensorboard import TensorBoard
from easyfit.callbacks.terminate_on_nan import TerminateOnNaN

__all__ = ["Callback", "CallbackList", "History", "ProgressBar", "EpochSummary", "EarlyStopping", "ModelCheckpoint",
           "LearningRateScheduler", "CSVLogger", "TerminateOnNaN", "ReduceLROnPlateau", "LambdaCallback",
           "BackupAndRestore", "TensorBoard", "MLflowLogger", "WandbLogger", "EMA", "SWA", "WeightAveraging",
           "OptunaPruning", "TuneReport", "ThroughputMonitor", "Profiler"]

#: the callbacks around the fit, each imported on first use (`import easyfit` stays light)
AROUND = {"MLflowLogger": "mlflow_logger", "WandbLogger": "wandb_logger", "EMA": "weight_averaging",
          "SWA": "weight_averaging", "WeightAveraging": "weight_averaging", "OptunaPruning": "optuna_pruning",
          "TuneReport": "ray_report", "ThroughputMonitor": "throughput", "Profiler": "profiler"}


def __getattr__(name: str):
    if name in AROUND:
        return getattr(importlib.import_module(f"easyfit.callbacks.{AROUND[name]}"), name)
    raise AttributeError(f"module 'easyfit.callbacks' has no attribute {name!r}")
