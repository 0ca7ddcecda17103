"""find_batch_size's memory budget on the CPU when none is given: a share of the memory the machine has free.

Running out of memory on the CPU ends the process (the kernel's OOM killer) instead of raising, so every trial there
is measured against a budget: `max_memory`, or by default this process's resident memory plus `SHARE` of the memory
free (Linux's MemAvailable, or what a container's cgroup limit leaves if less), split between the processes of this
machine.
"""
from __future__ import annotations

import os

#: the share of the free memory the trials may take together
SHARE = 0.8
GIB = 2 ** 30


def free_memory(meminfo: str = "/proc/meminfo", cgroup: str = "/sys/fs/cgroup") -> tuple[int, str] | None:
    """(bytes free, where that was read): MemAvailable, or a cgroup's limit less its usage when that is lower; None
    where neither can be read (not Linux)."""
    found = []
    try:
        with open(meminfo) as lines:
            kilobytes = next(int(line.split()[1]) for line in lines if line.startswith("MemAvailable:"))
        found.append((kilobytes * 1024, "MemAvailable in /proc/meminfo"))
    except (OSError, StopIteration, ValueError, IndexError):
        pass
    for limit, usage in (("memory.max", "memory.current"), ("memory/memory.limit_in_bytes",
                                                           "memory/memory.usage_in_bytes")):
        limit_bytes, usage_bytes = _read_int(os.path.join(cgroup, limit)), _read_int(os.path.join(cgroup, usage))
        if limit_bytes is not None and usage_bytes is not None and limit_bytes < 2 ** 60:   # "max": no limit
            found.append((max(limit_bytes - usage_bytes, 0), f"the container's memory limit ({cgroup}/{limit}) "
                                                             "less its usage"))
    return min(found) if found else None


def _read_int(path: str) -> int | None:
    try:
        with open(path) as file:
            return int(file.read().strip())
    except (OSError, ValueError):
        return None


def resident_memory() -> int:
    """This process's resident memory now (VmRSS), in bytes."""
    with open("/proc/self/status") as status:
        return int(next(line.split()[1] for line in status if line.startswith("VmRSS:"))) * 1024


def can_measure() -> bool:
    """Whether a trial's peak memory can be measured here (Linux's /proc, with a resettable peak)."""
    return free_memory() is not None and os.path.exists("/proc/self/status") and \
        os.access("/proc/self/clear_refs", os.W_OK)


def default_budget(processes: int) -> tuple[int, str]:
    """(bytes of peak memory per process, the words saying where the number came from)."""
    free, source = free_memory()
    resident = resident_memory()
    budget = resident + int(SHARE * free / processes)
    per = f" / {processes} processes on this machine" if processes > 1 else ""
    return budget, (f"a memory budget of {budget / GIB:.2f} GiB per process: its {resident / GIB:.2f} GiB now + "
                    f"{SHARE:.0%} of the {free / GIB:.2f} GiB free ({source}){per}; pass max_memory= (bytes) to "
                    "choose another")
