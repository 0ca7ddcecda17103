"""find_batch_size on the CPU without max_memory: a budget from the memory the machine has free, said in one line;
and data it cannot search on."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import easyfit
from easyfit.tuning import batch_size_finder, memory_budget

pytestmark = pytest.mark.skipif(not memory_budget.can_measure(), reason="needs Linux's /proc to measure memory")
MIB = 2 ** 20


class MemoryPerSample(nn.Module):
    """A net whose forward touches 4 MiB per sample (a stand-in for activations that grow with the batch)."""

    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(4, 3)

    def forward(self, x):
        scratch = torch.ones(len(x), MIB, device=x.device)
        return self.layer(x) + scratch.sum() * 0


def test_the_default_budget_comes_from_the_free_memory_and_is_said(classification, monkeypatch, capsys):
    monkeypatch.setattr(memory_budget, "free_memory", lambda *args: (200 * MIB, "MemAvailable in /proc/meminfo"))
    found = easyfit.Model(MemoryPerSample(), "cross_entropy", "sgd").find_batch_size(*classification)
    said = capsys.readouterr().out
    assert "find_batch_size on the CPU: a memory budget of" in said and "80% of the 0.20 GiB free (MemAvailable" in said
    assert 16 <= found <= 40   # 160 MiB of growth at 4 MiB a sample: about 40, less what the step itself takes
    unlimited = easyfit.Model(MemoryPerSample(), "cross_entropy", "sgd").find_batch_size(
        *classification, max_memory=2 ** 40)   # max_memory overrides the default, silently
    assert unlimited == len(classification[0]) and capsys.readouterr().out == ""


def test_free_memory_is_the_lower_of_memavailable_and_a_cgroup_limit(tmp_path):
    (tmp_path / "meminfo").write_text("MemTotal: 8000000 kB\nMemAvailable: 4000000 kB\n")
    cgroup = tmp_path / "cgroup"
    cgroup.mkdir()
    assert memory_budget.free_memory(str(tmp_path / "meminfo"), str(cgroup)) == (4000000 * 1024,
                                                                                 "MemAvailable in /proc/meminfo")
    (cgroup / "memory.max").write_text("2000000000\n")
    (cgroup / "memory.current").write_text("500000000\n")
    free, source = memory_budget.free_memory(str(tmp_path / "meminfo"), str(cgroup))
    assert free == 1500000000 and "memory limit" in source
    (cgroup / "memory.max").write_text("max\n")
    assert memory_budget.free_memory(str(tmp_path / "meminfo"), str(cgroup))[0] == 4000000 * 1024


def test_without_a_way_to_measure_memory_the_cpu_search_asks_for_a_bound(classification, monkeypatch):
    monkeypatch.setattr(batch_size_finder, "can_measure", lambda: False)
    with pytest.raises(ValueError, match="give find_batch_size max_memory"):
        easyfit.Model(nn.Linear(4, 3), "cross_entropy", "sgd").find_batch_size(*classification, accelerator="cpu")


def test_empty_data_is_said_to_be_empty(classification):
    x, y = classification
    with pytest.raises(ValueError, match=r"the data is empty \(0 samples\)"):
        easyfit.Model(nn.Linear(4, 3), "cross_entropy", "sgd").find_batch_size(x[:0], y[:0], max_memory=2 ** 40)
