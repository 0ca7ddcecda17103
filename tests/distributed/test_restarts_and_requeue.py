"""Fault tolerance in one test process: restarts exhausted (spawned ranks), SLURM's time-limit signal with a fake
`scontrol`, and the options' checks. The multi-process runs are in tests/distributed/test_fault_tolerance.py."""
from __future__ import annotations

import itertools
import multiprocessing
import os
import signal
import stat
from types import SimpleNamespace

import pytest
import torch

import easyfit
from easyfit.callbacks import Callback
from easyfit.distributed import fault_tolerance
from easyfit.distributed.launchers.restarts import RestartsExhaustedError
from easyfit.distributed.strategies.base import Strategy
from easyfit.saving.resume import EpochPosition
from easyfit.training.running_call import RunningCall


class RaiseOnRank1(Callback):
    def on_train_batch_end(self, batch, logs=None):
        if self.model.global_rank == 1 and batch == 1:
            raise RuntimeError("deliberate failure on rank 1")


def test_restarts_exhausted_name_the_last_failure_and_the_restarts_tried(make_net, classification, tmp_path, capfd):
    x, y = classification
    model = easyfit.Model(make_net(), "cross_entropy", "sgd")
    # spawned, not forked: earlier tests leave threads in this process (Horovod's runner) that a fork copies mid-way
    with pytest.raises(RestartsExhaustedError) as error:
        model.fit(x, y, epochs=2, batch_size=16, verbose=0, callbacks=[RaiseOnRank1()], strategy="ddp_spawn",
                  devices=2, accelerator="cpu", max_restarts=1, fault_tolerance=str(tmp_path))
    assert error.value.rank == 1 and error.value.restarts == 1
    assert str(error.value).startswith("rank 1 failed again after 1 restart(s) (max_restarts=1); all ranks were "
                                       "stopped. The last failure:")
    assert "RuntimeError: deliberate failure on rank 1" in str(error.value)
    assert ("easyfit: attempt 1 failed: rank 1: RuntimeError: deliberate failure on rank 1; restarting every rank "
            "(restart 1 of 1)") in capfd.readouterr().err
    assert multiprocessing.active_children() == []


class SignalAt(Callback):
    """Sends this process SLURM's time-limit signal at one batch."""

    def __init__(self, epoch: int, batch: int):
        self.at, self.epoch = (epoch, batch), 0

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if (self.epoch, batch) == self.at:
            os.kill(os.getpid(), signal.SIGUSR1)


@pytest.fixture
def slurm_job(tmp_path, monkeypatch):
    """A requeueable SLURM job 4242: a fake `scontrol` on PATH that logs its arguments."""
    bin_dir, log = tmp_path / "bin", tmp_path / "scontrol.log"
    bin_dir.mkdir()
    scontrol = bin_dir / "scontrol"
    scontrol.write_text(f'#!/bin/sh\necho "$@" >> {log}\n'
                        'if [ "$1" = show ]; then echo "JobId=$4 JobName=train Requeue=1 Restarts=0"; fi\n')
    scontrol.chmod(scontrol.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    return log


def _fit(model, x, y, folder, callbacks=()):
    fault_tolerance._fit_calls = itertools.count(1)   # as in a new process (a requeued job starts the script anew)
    return model.fit(x, y, epochs=3, batch_size=16, verbose=0, callbacks=list(callbacks), fault_tolerance=folder)


def test_slurm_signal_saves_requeues_and_the_requeued_job_continues_exactly(make_net, classification, tmp_path,
                                                                             slurm_job, monkeypatch, capfd):
    x, y = classification
    folder = tmp_path / "checkpoints"
    with pytest.raises(SystemExit) as stop:
        _fit(easyfit.Model(make_net(), "cross_entropy", "adam"), x, y, folder, [SignalAt(epoch=1, batch=2)])
    assert stop.value.code == 0
    assert slurm_job.read_text().splitlines() == ["show job -o 4242", "requeue 4242"]
    assert "job 4242 requeued" in capfd.readouterr().err
    assert [path.name for path in folder.iterdir()] == ["4242-fit1"]

    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    requeued = easyfit.Model(make_net(), "cross_entropy", "adam")
    history = _fit(requeued, x, y, folder)
    assert "easyfit: effective batch 16 = 16 × 1 process; lr 0.001 (not scaled); resumed after requeue 1 from " \
           "epoch 2, step 3" in capfd.readouterr().err
    assert list(folder.iterdir()) == [] and len(history.history["loss"]) == 3

    monkeypatch.delenv("SLURM_JOB_ID")
    straight = easyfit.Model(make_net(), "cross_entropy", "adam")
    expected = _fit(straight, x, y, folder)
    assert history.history["loss"] == pytest.approx(expected.history["loss"], abs=1e-6)
    for name, value in straight.net.state_dict().items():
        assert torch.equal(requeued.net.state_dict()[name], value), name


def test_fault_tolerance_is_off_without_a_launcher_that_restarts_or_when_turned_off(tmp_path, monkeypatch):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    assert fault_tolerance.restartable_fit(None, 0, Strategy()) is None
    assert fault_tolerance.restartable_fit(False, 2, Strategy()) is None
    run = fault_tolerance.restartable_fit(str(tmp_path), 2, Strategy())
    assert run.launcher == "easyfit" and run.restart == 0 and run.resume_from is None
    assert os.path.dirname(run.path) == str(tmp_path)


@pytest.mark.parametrize("option, message", [
    ({"max_restarts": -1}, "max_restarts must be a non-negative integer"),
    ({"fault_tolerance_every_n_steps": 0}, "fault_tolerance_every_n_steps must be a positive number"),
    ({"fault_tolerance": 3}, "fault_tolerance must be False"),
])
def test_bad_fault_tolerance_options_fail_before_training(make_net, classification, option, message):
    with pytest.raises((ValueError, TypeError), match=message):
        easyfit.Model(make_net()).fit(*classification, verbose=0, **option)


def test_max_restarts_under_torchrun_says_to_let_torchrun_restart(make_net, classification, monkeypatch):
    for name, value in {"TORCHELASTIC_RUN_ID": "job", "RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0",
                        "GROUP_RANK": "0", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                        "MASTER_PORT": "29500"}.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=r"torchrun started these: let it restart them \(torchrun --max-restarts=2"):
        easyfit.Model(make_net()).fit(*classification, verbose=0, accelerator="cpu", max_restarts=2)


def test_a_restart_on_more_processes_trains_again_the_samples_of_a_partial_global_batch(make_net):
    """1 -> 2 processes, 3 batches of 16 done: 48 samples are one new global batch of 32 and half of the next, so
    the epoch continues at step 1 and 16 samples are trained again (the 2 -> 1 case runs for real in
    tests/distributed/test_fault_tolerance.py)."""
    model = easyfit.Model(make_net(), "cross_entropy", "sgd", lr=0.05)   # the schedule's LR: each step scales it
    model.running = RunningCall(SimpleNamespace(world_size=2, batch_factor=2, is_global_zero=True), model.precision)
    model.completed_epochs, model.position = 1, EpochPosition(batches_done=3)
    run = fault_tolerance.RestartableFit("torchrun", "unused", restart=1, resume_from="unused")
    state = {"lr_multiplier": 1.0, fault_tolerance.WORLD_KEY: {"world_size": 1, "batch_factor": 1}}
    note = fault_tolerance.resume_note(model, run, state, batch_size=16, accumulate=1, multiplier=2.0)
    assert note == ("resumed after restart 1 from epoch 2, step 3; world size 1 → 2: the data re-sharded over 2 "
                    "processes (the epoch continues at step 1, 16 of its samples trained again), lr 0.05 → 0.1")
    assert model.position.batches_done == 1 and model.position.resuming
