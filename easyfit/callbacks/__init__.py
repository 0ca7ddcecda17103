"""Callbacks with Keras' names and hooks. Subclass `Callback` for your own."""
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
           "BackupAndRestore", "TensorBoard"]
