"""On 2 CPU processes (DDP): a compiled fit equals eager, find_lr gives every rank the same curve and suggestion
and changes nothing, and find_batch_size gives every rank the smallest rank's answer."""
from __future__ import annotations

import torch
from runner import assert_same_weights, run_script


def _equal(one, other) -> bool:
    if isinstance(one, torch.Tensor):
        return torch.equal(one, other)
    if isinstance(one, dict):
        return one.keys() == other.keys() and all(_equal(one[key], other[key]) for key in one)
    if isinstance(one, (list, tuple)):
        return len(one) == len(other) and all(_equal(a, b) for a, b in zip(one, other))
    return one == other


def test_compile_and_the_finders_under_ddp(tmp_path):
    process = run_script(tmp_path, script="compile_finders.py", timeout=240)
    assert process.returncode == 0, process.stderr[-4000:]
    ranks = [torch.load(tmp_path / f"rank{rank}.pt", weights_only=False) for rank in (0, 1)]
    for rank in ranks:
        assert rank["graphs"]["unique_graphs"] >= 2, rank["graphs"]   # the step and the optimizer step compiled
        assert rank["linear_calls"] == 2   # the nn.Sequential inside DDP compiled too, not run eagerly
        assert_same_weights(rank["compiled"], rank["eager"], atol=1e-5)
        assert _equal(rank["before"], rank["after_lr"])   # find_lr left weights, optimizer and RNG as they were
        assert rank["batch_size"] == 20   # rank 1 runs out of memory from 21, rank 0 from 37
    assert ranks[0]["lrs"] == ranks[1]["lrs"] and ranks[0]["losses"] == ranks[1]["losses"]
    assert ranks[0]["suggestion"] == ranks[1]["suggestion"] is not None
