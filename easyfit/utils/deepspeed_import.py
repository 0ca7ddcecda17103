"""Importing deepspeed without the experiment tracker its autotuner loads.

DeepSpeed's autotuner imports mlflow, where it is installed, as the deepspeed package is imported, for its own logging
of tuning runs (started by DeepSpeed's launcher with `--autotuning`), which a fit never runs. That import is most of
deepspeed's: 1.6 of 2.0 CPU-s on 2 cores, paid by every rank of a DeepSpeed fit.
"""
from __future__ import annotations

import contextlib
import sys

#: the tracker DeepSpeed's autotuner imports, when installed, as deepspeed is imported
AUTOTUNER_TRACKER = "mlflow"


@contextlib.contextmanager
def autotuner_tracker_hidden():
    """Around the first import of deepspeed: mlflow, unless already imported, reads as not installed (a `None` in
    `sys.modules` makes its import raise ImportError, which the autotuner takes as "no mlflow") and is importable as
    usual afterwards. Where deepspeed or mlflow is already imported, nothing changes."""
    if "deepspeed" in sys.modules or AUTOTUNER_TRACKER in sys.modules:
        yield
        return
    sys.modules[AUTOTUNER_TRACKER] = None
    try:
        yield
    finally:
        if AUTOTUNER_TRACKER in sys.modules and sys.modules[AUTOTUNER_TRACKER] is None:
            del sys.modules[AUTOTUNER_TRACKER]
