"""The rendezvous store of one attempt of a restarted run, so that restarted ranks meet.

torchrun's agent keeps one store for the whole job and restarts its workers with the same MASTER_ADDR:MASTER_PORT;
easyfit's own `max_restarts` may meet on the same port again too (a MASTER_PORT the user gave). The keys the previous
attempt's process group left there (each rank's address) can still be present, and a restarted rank that read a
peer's old address would wait on a dead port. Each attempt's process group therefore meets under keys of its own: the
restart count, the world size, and a generation counted in the store (torchrun keeps the restart count over restarts
that change the membership).
"""
from __future__ import annotations

import os
from datetime import timedelta

from easyfit.distributed.environments import RESTART_COUNT_VARIABLE, ClusterEnvironment, LocalEnvironment


def attempt_number(environment: ClusterEnvironment) -> str | None:
    """The attempt of a run whose ranks torchrun or easyfit's own launcher start (restarted or not); None under
    other launchers, which do not restart ranks (torch's own rendezvous serves them)."""
    if "TORCHELASTIC_RESTART_COUNT" in os.environ:
        return os.environ["TORCHELASTIC_RESTART_COUNT"]
    if isinstance(environment, LocalEnvironment):   # ranks started early by easyfit.launch() carry no count: 0
        return os.environ.get(RESTART_COUNT_VARIABLE, "0")
    return None


def attempt_store(environment: ClusterEnvironment, world_size: int, global_rank: int, timeout: timedelta):
    """A store whose keys belong to this attempt alone, at MASTER_ADDR:MASTER_PORT; None: torch's own rendezvous."""
    attempt = attempt_number(environment)
    if attempt is None:
        return None
    from torch.distributed import PrefixStore, TCPStore
    agent_hosts = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"   # else rank 0 hosts it (or has already)
    store = TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size,
                     is_master=not agent_hosts and global_rank == 0, timeout=timeout, wait_for_workers=False,
                     multi_tenant=True)
    keys = PrefixStore(f"easyfit/attempt_{attempt}/world_{world_size}/", store)
    generation = (keys.add("joined", 1) - 1) // world_size
    return PrefixStore(f"generation_{generation}/", keys)
