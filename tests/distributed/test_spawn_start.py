"""ddp_spawn's ranks start from a fork server (started once per caller, with torch and easyfit imported), yet take
what a freshly spawned process takes from the caller at each call: its environment variables and its standard output
and error, not the ones the server had when it started."""
from __future__ import annotations

import multiprocessing
import os
import sys
import types

import pytest
import torch
from runner import result, run_script
from torch import nn

import easyfit
from easyfit.callbacks import Callback
from easyfit.distributed.launchers.spawn import process_start

pytestmark = pytest.mark.timeout(240)


class ReadVariable(Callback):
    """Records, in rank 0, an environment variable as the rank sees it (callbacks come back from rank 0)."""

    def on_train_begin(self, logs=None):
        self.value = os.environ.get("EASYFIT_TEST_SPAWN_MARK")


def _fit(model, callback):
    x = torch.randn(64, 4, generator=torch.Generator().manual_seed(0))
    model.fit(x, (x[:, 0] > 0).long(), epochs=1, batch_size=16, verbose=2, callbacks=[callback], devices=2,
              accelerator="cpu", strategy="ddp_spawn")


@pytest.mark.skipif("forkserver" not in multiprocessing.get_all_start_methods(), reason="no fork server here")
def test_spawned_ranks_take_the_caller_s_output_and_environment_at_each_call(capfd, monkeypatch):
    assert process_start("spawn") == "forkserver"
    model = easyfit.Model(nn.Linear(4, 2), "cross_entropy", "sgd", metrics=["accuracy"])
    first = ReadVariable()
    with capfd.disabled():   # the server may start here, its output the terminal's
        monkeypatch.setenv("EASYFIT_TEST_SPAWN_MARK", "first")
        _fit(model, first)
    monkeypatch.setenv("EASYFIT_TEST_SPAWN_MARK", "second")
    second = ReadVariable()
    _fit(model, second)
    assert (first.value, second.value) == ("first", "second")
    assert "Epoch 1/1" in capfd.readouterr().out, "rank 0's progress must reach the caller's output of this call"


@pytest.mark.skipif("forkserver" not in multiprocessing.get_all_start_methods(), reason="no fork server here")
def test_the_server_imports_what_each_rank_would_import_again(monkeypatch):
    """torch._dynamo (which torch's optimizers import, 1.2 s a process) and a caller's torchmetrics are imported once,
    by the server, not in every rank of every fit: a later ddp_spawn fit of 2 ranks started in 1.5 s, now 0.3 s."""
    import torch._dynamo  # noqa: F401  (any optimizer's constructor imports it)
    chosen = []
    monkeypatch.setattr(multiprocessing, "set_forkserver_preload", chosen.extend)
    monkeypatch.setitem(sys.modules, "torchmetrics", sys.modules.get("torchmetrics", types.ModuleType("torchmetrics")))
    assert process_start("spawn") == "forkserver"
    assert {"easyfit", "torch._dynamo", "torchmetrics"} <= set(chosen), chosen


@pytest.mark.skipif("forkserver" not in multiprocessing.get_all_start_methods(), reason="no fork server here")
def test_under_a_temporary_directory_too_long_for_the_server_s_socket_the_ranks_are_spawned(tmp_path):
    """A cluster job's TMPDIR can be longer than a Unix socket's path may be (107 bytes on Linux), where the fork
    server cannot listen ("AF_UNIX path too long"): the ranks are spawned instead, and the fit trains on both."""
    temporary = tmp_path / ("job-" + "0" * max(1, 110 - len(str(tmp_path))))
    temporary.mkdir()
    process = run_script(tmp_path, "ddp_spawn", "--epochs", "1", env={"TMPDIR": str(temporary)}, timeout=200)
    assert process.returncode == 0, process.stderr[-4000:]
    assert result(tmp_path)["world_size"] == 2
