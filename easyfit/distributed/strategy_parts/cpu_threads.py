"""Each rank's share of the CPU cores when easyfit itself starts several processes on one machine's CPU.

A process starts with a thread per core, so N ranks on the CPU run N threads per core and spend their steps waiting
on each other (torchrun sets OMP_NUM_THREADS=1 for this reason). Unless the user chose (OMP_NUM_THREADS set), each
rank of easyfit's own launch runs cores // N threads (`torch.set_num_threads`, never more than it had) while a call
runs, and the summary line says so.
"""
from __future__ import annotations

import os

import torch


def available_cores() -> int:
    """The cores this process may run on (its CPU affinity, which a container or taskset narrows)."""
    affinity = getattr(os, "sched_getaffinity", None)
    return len(affinity(0)) if affinity is not None else os.cpu_count() or 1


class CoreShare:
    """Sets a rank's threads to its share of the cores for a call (`apply`), and back after it (`restore`)."""

    def __init__(self):
        self.previous: int | None = None
        self.note: str | None = None   # the summary line's words, while a share is set

    def apply(self, processes: int) -> None:
        """Give this rank, one of `processes` on this machine's CPU, its share of the cores."""
        cores, current = available_cores(), torch.get_num_threads()
        share = max(1, cores // processes)
        if processes < 2 or "OMP_NUM_THREADS" in os.environ or current <= share:
            return
        self.previous = current
        torch.set_num_threads(share)
        self.note = (f"{share} CPU thread{'s' if share > 1 else ''} per process ({cores} cores / {processes} "
                     "processes; set OMP_NUM_THREADS to choose)")

    def restore(self) -> None:
        if self.previous is not None:
            torch.set_num_threads(self.previous)
        self.previous = self.note = None
