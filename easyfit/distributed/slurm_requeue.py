"""SLURM: on the signal sent before the time limit (`#SBATCH --signal=SIGUSR1@90`), the fit writes its
fault-tolerance checkpoint and requeues the job (`scontrol requeue $SLURM_JOB_ID`); the requeued job restores it.

SLURM exports no variable that says the job may be requeued (`sbatch --requeue`, or the cluster's JobRequeue
default): `scontrol show job` does ("Requeue=1"), so that is what is asked, once per fit.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading

from easyfit.distributed.environments.slurm import INTERACTIVE_SLURM_JOBS

REQUEUE_SIGNAL = signal.SIGUSR1
SCONTROL_TIMEOUT_SECONDS = 30


def requeueable() -> bool:
    """True in a SLURM batch job that may be requeued."""
    job = os.environ.get("SLURM_JOB_ID", "").strip()
    if not job or os.environ.get("SLURM_JOB_NAME") in INTERACTIVE_SLURM_JOBS:
        return False
    try:
        shown = subprocess.run(["scontrol", "show", "job", "-o", job], capture_output=True, text=True,
                               timeout=SCONTROL_TIMEOUT_SECONDS)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return re.search(r"\bRequeue=1\b", shown.stdout) is not None


class RequeueSignal:
    """Records the signal when it arrives (a handler cannot save mid-step); the ranks then agree at a step's end."""

    def __init__(self):
        self.received = False
        self.previous = None

    def install(self) -> None:
        if threading.current_thread() is threading.main_thread():   # Python delivers signals to the main thread
            self.previous = signal.signal(REQUEUE_SIGNAL, self._receive)

    def uninstall(self) -> None:
        if self.previous is not None:
            signal.signal(REQUEUE_SIGNAL, self.previous)
            self.previous = None

    def _receive(self, signum, frame) -> None:
        self.received = True

    def agreed(self, strategy) -> bool:
        """Whether any rank received the signal (one tiny collective per step on several processes: SLURM signals
        every rank, but each at its own point of the step)."""
        return strategy.any_rank(self.received)

    def requeue_job(self, model) -> None:
        """Rank 0 requeues the job; then every rank ends (the checkpoint is already written)."""
        job = os.environ["SLURM_JOB_ID"]
        if model.is_global_zero:
            done = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True,
                                  timeout=SCONTROL_TIMEOUT_SECONDS)
            outcome = "requeued" if done.returncode == 0 else \
                f"could not be requeued (scontrol: {(done.stderr or done.stdout).strip()})"
            print(f"easyfit: SLURM's time-limit signal arrived; the fault-tolerance checkpoint is written and job "
                  f"{job} {outcome}", file=sys.stderr, flush=True)
        self.uninstall()
        raise SystemExit(0)
