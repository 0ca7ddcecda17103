"""easyfit's own multi-process launch on the CPU gives each rank its share of the cores, unless the user chose."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

import easyfit
from easyfit.callbacks import Callback
from easyfit.distributed.strategy_parts import cpu_threads
from easyfit.distributed.strategy_parts.cpu_threads import CoreShare, available_cores


class Threads(Callback):
    """The torch threads rank 0 trains with (its attributes come back to the caller)."""

    def on_train_begin(self, logs=None):
        self.threads = torch.get_num_threads()


@pytest.fixture
def four_cores(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(cpu_threads, "available_cores", lambda: 4)
    previous = torch.get_num_threads()
    torch.set_num_threads(4)
    yield
    torch.set_num_threads(previous)


def test_a_rank_gets_its_share_while_a_call_runs(four_cores):
    share = CoreShare()
    share.apply(2)
    assert torch.get_num_threads() == 2 and share.note == "2 CPU threads per process (4 cores / 2 processes; set " \
                                                         "OMP_NUM_THREADS to choose)"
    share.restore()
    assert torch.get_num_threads() == 4 and share.note is None


@pytest.mark.parametrize("chosen", ["omp", "fewer threads", "one process"])
def test_what_the_user_chose_is_kept(four_cores, monkeypatch, chosen):
    processes = 1 if chosen == "one process" else 2
    if chosen == "omp":
        monkeypatch.setenv("OMP_NUM_THREADS", "4")
    if chosen == "fewer threads":
        torch.set_num_threads(1)
    before = torch.get_num_threads()
    share = CoreShare()
    share.apply(processes)
    assert torch.get_num_threads() == before and share.note is None


@pytest.mark.skipif(available_cores() < 2, reason="needs 2 cores to share")
@pytest.mark.timeout(240)
def test_spawned_ranks_train_with_their_share_and_the_summary_says_so(all_cores, monkeypatch, capfd):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    x = np.random.default_rng(0).normal(size=(64, 4)).astype("float32")
    threads = Threads()
    easyfit.Model(nn.Linear(4, 2), "cross_entropy", "sgd").fit(
        x, (x[:, 0] > 0).astype("int64"), epochs=1, verbose=2, callbacks=[threads], devices=2, accelerator="cpu",
        strategy="ddp_spawn")
    share = max(1, available_cores() // 2)
    assert threads.threads == share
    assert f"{share} CPU thread{'s' if share > 1 else ''} per process ({available_cores()} cores / 2 processes" \
        in capfd.readouterr().out
