"""How calls reach the Horovod strategy, without starting processes (Horovod itself need not be installed)."""
from __future__ import annotations

import importlib.util
import os
import sys
from types import SimpleNamespace

import pytest
import torch

from easyfit.distributed import calls
from easyfit.distributed.connector import connect
from easyfit.distributed.strategies.horovod import HorovodStrategy, import_horovod

HOROVODRUN = {"HOROVOD_SIZE": "2", "HOROVOD_RANK": "1", "HOROVOD_LOCAL_RANK": "1", "HOROVOD_LOCAL_SIZE": "2",
              "HOROVOD_CROSS_RANK": "0", "HOROVOD_GLOO_RENDEZVOUS_ADDR": "127.0.0.1"}
OPEN_MPI = {"OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
            "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}


@pytest.fixture(autouse=True)
def plain_script(monkeypatch):
    for name in [name for name in os.environ if name.startswith(("HOROVOD_", "OMPI_", "PMI_", "SLURM_", "EASYFIT_"))
                 or name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_RUN_ID", "GROUP_RANK")]:
        monkeypatch.delenv(name)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(calls, "is_interactive", lambda: False)


@pytest.mark.skipif(importlib.util.find_spec("horovod") is None,
                    reason="horovod is not installed: scripts/install_horovod.sh builds it")
def test_auto_under_horovodrun_picks_horovod_and_its_ranks(monkeypatch):
    for name, value in HOROVODRUN.items():
        monkeypatch.setenv(name, value)
    strategy = connect("auto", accelerator="cpu")
    assert isinstance(strategy, HorovodStrategy)
    assert strategy.make_launcher() is None, "horovodrun started the ranks"
    assert (strategy.world_size, strategy.num_processes) == (2, 2)


def test_auto_under_plain_mpirun_stays_ddp(monkeypatch):
    for name, value in OPEN_MPI.items():
        monkeypatch.setenv(name, value)
    assert connect("auto", accelerator="cpu").name == "ddp"
    assert isinstance(connect("horovod", accelerator="cpu"), HorovodStrategy), "horovod by name under mpirun"


def test_devices_from_a_plain_script_use_the_horovod_run_launcher():
    from easyfit.distributed.launchers.horovod import HorovodLauncher
    strategy = connect("horovod", devices=2, accelerator="cpu")
    assert isinstance(strategy.make_launcher(), HorovodLauncher)
    assert not strategy.make_launcher().rank_zero_in_caller
    assert connect("horovod", devices=1, accelerator="cpu").make_launcher() is None


def test_several_machines_without_horovodrun_say_how_to_launch():
    with pytest.raises(ValueError, match=r"horovodrun -np 8 -H host1:4,host2:4 python train.py"):
        connect("horovod", devices=1, accelerator="cpu", num_nodes=2)


def test_missing_horovod_names_the_install_script(monkeypatch):
    monkeypatch.setitem(sys.modules, "horovod.torch", None)   # `import horovod.torch` raises ImportError
    with pytest.raises(ImportError, match=r"scripts/install_horovod\.sh"):
        import_horovod()


def test_gradient_accumulation_becomes_backward_passes_per_step():
    assert HorovodStrategy.backward_passes_per_step(SimpleNamespace(gradient_accumulation_steps=4)) == 4
    assert HorovodStrategy.backward_passes_per_step(None) == 1


def test_bad_compression_is_refused_up_front():
    with pytest.raises(ValueError, match="compression must be 'none' or 'fp16'"):
        HorovodStrategy(compression="int8")
