"""The rendezvous store of one attempt of torchrun's agent, so that restarted workers meet.

torchrun's agent keeps one store for the whole job and restarts its workers with the same MASTER_ADDR:MASTER_PORT.
The keys the previous attempt's process group left there (each rank's address) are still present, and a restarted
rank that reads a peer's old address before the peer has written its new one waits on a dead port. Each attempt's
process group therefore meets under keys of its own: the agent's restart count, the world size, and a generation
counted in the store (restarts that change the membership keep the restart count).
"""
from __future__ import annotations

import os
from datetime import timedelta


def attempt_store(address: str, port: int, world_size: int, global_rank: int, timeout: timedelta):
    """Under torchrun, a store whose keys belong to this attempt alone; None elsewhere (torch's own rendezvous)."""
    if "TORCHELASTIC_RESTART_COUNT" not in os.environ:
        return None
    from torch.distributed import PrefixStore, TCPStore
    agent_hosts = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = TCPStore(address, port, world_size, is_master=not agent_hosts and global_rank == 0, timeout=timeout,
                     wait_for_workers=False, multi_tenant=True)
    attempt = PrefixStore(f"easyfit/attempt_{os.environ['TORCHELASTIC_RESTART_COUNT']}/world_{world_size}/", store)
    generation = (attempt.add("joined", 1) - 1) // world_size
    return PrefixStore(f"generation_{generation}/", attempt)
