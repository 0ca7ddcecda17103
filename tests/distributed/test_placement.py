"""A call's placement (world size, global / local / node rank, devices) is read from the launch environment once, when
the call's strategy is configured for this process, and frozen: nothing re-reads the environment per access. Each
rank of a real 2-process ddp fit counts its calls into easyfit/distributed/environments/ (tests/distributed/scripts/
environment_reads.py): a fit of 4 epochs makes no more of them than a fit of 1, and both stay few (before the
placement was frozen: 190 and 298 on rank 0, 767 and 1,343 on rank 1; now 55 and 99, whatever the epochs)."""
from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist
from runner import run_script

from easyfit.distributed.connector import connect
from easyfit.distributed.strategies.parallel import Placement, destroy_process_group

pytestmark = pytest.mark.timeout(300)

#: calls into the environments package one fit may make on a rank: detection, the launcher, one placement read
#: (15 on rank 0 and 23 on rank 1, whose environment read whether easyfit's launcher started it on every question: 62)
MOST_READS = 30


def test_a_ddp_fit_reads_its_ranks_from_the_environment_once_not_per_step(tmp_path):
    process = run_script(tmp_path, script="environment_reads.py", timeout=280)
    assert process.returncode == 0, process.stderr[-6000:]
    for rank in (0, 1):
        counts = json.loads((tmp_path / f"{rank}.json").read_text())
        assert counts["4"] == counts["1"], (rank, counts)   # 4 times the steps, not one more read
        assert counts["1"] <= MOST_READS, (rank, counts)


def test_the_placement_is_frozen_when_the_strategy_is_configured(monkeypatch):
    """Once the call's strategy is configured for this process its ranks are the call's, through its environment's
    setup and teardown, even if the variables change under it; a new configuration reads them afresh."""
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    group_before = dist.is_initialized()
    strategy = connect("ddp", devices=1, accelerator="cpu")
    monkeypatch.setenv("NODE_RANK", "3")   # read by the environment on every question it is asked
    call = strategy.setup_environment()
    try:
        assert strategy.placement == Placement(world_size=1, global_rank=0, local_rank=0, node_rank=0)
        assert (strategy.node_rank, strategy.global_rank, strategy.root_device) == (0, 0, torch.device("cpu"))
        # plain values of the configured strategy, read without a call on every step
        assert {"world_size", "global_rank", "local_rank", "node_rank", "root_device"} <= set(vars(strategy))
    finally:
        strategy.teardown(call)
        if not group_before:   # one process's group, kept for later calls of a script: not for later tests
            destroy_process_group()
    assert strategy.node_rank == 0 and strategy.read_placement().node_rank == 3
