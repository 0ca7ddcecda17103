"""Checkpoints are data: a file whose unpickling would run code is refused, without running it, by every call that
reads a file; every file easyfit writes loads with `weights_only=True`; a trusted old-format file still loads."""
from __future__ import annotations

import ast
import itertools
import os
import pathlib
import stat
import subprocess
import sys
import time
from collections import OrderedDict

import numpy as np
import pytest
import torch
from code_scan import calls_in_easyfit
from torch import nn

import easyfit
from easyfit.callbacks import BackupAndRestore, Callback, EarlyStopping, ModelCheckpoint
from easyfit.distributed import fault_tolerance
from easyfit.distributed.strategies.single import SingleDeviceStrategy
from easyfit.saving.backend_folders import check_dcp_folder
from easyfit.saving.checkpoint import (
    FORMAT_KEY,
    FSDP_META_FILE,
    DamagedFileError,
    UntrustedCheckpointError,
    as_data,
    numpy_generator,
    numpy_generator_state,
    temp_prefix,
)
from easyfit.saving.convert import convert_checkpoint

REFUSED = r"holds more than data \(.*\).*nothing in it was run.*trusted=True"


class Payload:
    """Unpickling it creates the file `marker`: what a hostile checkpoint would do with os.system."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return exec, (f"open({self.marker!r}, 'w').close()",)


@pytest.fixture
def hostile(tmp_path, make_net):
    """(a checkpoint-looking file with a payload in its history, the marker its unpickling would create)."""
    marker = tmp_path / "payload-ran"
    model = easyfit.Model(make_net(), "cross_entropy", "sgd")
    state = {FORMAT_KEY: 1, **model.checkpoint_state(), "history": Payload(marker)}
    path = tmp_path / "hostile.pt"
    torch.save(state, path)
    return path, marker


def test_the_payload_runs_when_unpickled(hostile):
    """The file is really hostile: torch.load(weights_only=False) runs it."""
    path, marker = hostile
    torch.load(path, weights_only=False)
    assert marker.exists()


def test_load_weights_and_model_load_refuse_it_without_running_it(hostile, make_net):
    path, marker = hostile
    model = easyfit.Model(make_net(seed=1), "cross_entropy", "sgd")
    before = {name: value.clone() for name, value in model.net.state_dict().items()}
    with pytest.raises(UntrustedCheckpointError, match=REFUSED):
        model.load_weights(path)
    with pytest.raises(UntrustedCheckpointError, match=REFUSED):
        easyfit.Model.load(path, net=make_net())
    assert not marker.exists()
    torch.testing.assert_close(model.net.state_dict(), before, rtol=0, atol=0)


def test_fit_resume_from_and_backup_and_restore_refuse_it_before_training(hostile, make_net, classification,
                                                                          tmp_path):
    path, marker = hostile
    x, y = classification
    model = easyfit.Model(make_net(), "cross_entropy", "sgd")
    with pytest.raises(UntrustedCheckpointError, match=REFUSED + r".*easyfit.checkpoint_convert.*--trusted"):
        model.fit(x, y, epochs=1, verbose=0, resume_from=str(path))
    backup = tmp_path / "backup"
    backup.mkdir()
    os.replace(path, backup / "backup.pt")
    with pytest.raises(UntrustedCheckpointError, match=REFUSED):
        model.fit(x, y, epochs=1, verbose=0, callbacks=[BackupAndRestore(backup)])
    assert not marker.exists() and model.completed_epochs == 0 and model.history.history == {}


def test_the_fault_tolerance_restore_refuses_it(hostile, make_net, classification, tmp_path, monkeypatch):
    """A requeued SLURM job (a fake scontrol) finds a hostile file where its fault-tolerance checkpoint would be."""
    path, marker = hostile
    scontrol = tmp_path / "bin" / "scontrol"
    scontrol.parent.mkdir()
    scontrol.write_text('#!/bin/sh\nif [ "$1" = show ]; then echo "JobId=$4 Requeue=1"; fi\n')
    scontrol.chmod(scontrol.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{scontrol.parent}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    folder = tmp_path / "checkpoints"
    folder.mkdir()
    os.replace(path, folder / "4242-fit1")
    fault_tolerance._fit_calls = itertools.count(1)
    x, y = classification
    with pytest.raises(UntrustedCheckpointError, match=REFUSED):
        easyfit.Model(make_net(), "cross_entropy", "sgd").fit(x, y, epochs=1, verbose=0, fault_tolerance=folder)
    assert not marker.exists()


def test_the_converter_refuses_hostile_files_and_folders(hostile, tmp_path):
    path, marker = hostile
    with pytest.raises(UntrustedCheckpointError, match=REFUSED):
        convert_checkpoint(path, tmp_path / "out.pt")
    command = subprocess.run([sys.executable, "-m", "easyfit.checkpoint_convert", str(path), str(tmp_path / "o.pt")],
                             capture_output=True, text=True, timeout=120)
    assert command.returncode != 0 and "UntrustedCheckpointError" in command.stderr
    # an FSDP folder whose torch.distributed.checkpoint metadata (a pickle torch reads with pickle.load) is hostile
    folder = tmp_path / "sharded"
    folder.mkdir()
    torch.save({FORMAT_KEY: 1, "param_names": []}, folder / FSDP_META_FILE)
    (folder / ".metadata").write_bytes(__import__("pickle").dumps(Payload(marker)))
    with pytest.raises(UntrustedCheckpointError, match=r"\.metadata.*names builtins\.exec"):
        convert_checkpoint(folder, tmp_path / "out.pt")
    with pytest.raises(UntrustedCheckpointError):
        check_dcp_folder(str(folder))
    assert not marker.exists() and not (tmp_path / "out.pt").exists() and not (tmp_path / "o.pt").exists()


def test_a_hostile_deepspeed_folder_is_refused_before_deepspeed_reads_it(hostile, tmp_path):
    pytest.importorskip("deepspeed", reason="pip install easyfit[deepspeed]")
    path, marker = hostile
    folder = tmp_path / "deepspeed"
    (folder / "checkpoint").mkdir(parents=True)
    (folder / "latest").write_text("checkpoint")
    os.replace(path, folder / "checkpoint" / "mp_rank_00_model_states.pt")
    with pytest.raises(UntrustedCheckpointError, match=REFUSED):
        convert_checkpoint(folder, tmp_path / "out.pt")
    assert not marker.exists()


# --- files written before checkpoints were data ---------------------------------------------------------------
def _old_format_file(model, path) -> None:
    """A checkpoint as an older easyfit could write it: torch.save of the state with numpy values in the History and a
    callback's state, and a numpy RandomState (DDP's PowerSGD state)."""
    state = model.checkpoint_state()
    state["history"]["history"] = {key: [np.float64(value) for value in values]
                                   for key, values in state["history"]["history"].items()}
    state["callbacks"]["EarlyStopping(monitor='loss')"]["best"] = np.float32(0.5)
    state["powersgd_rng"] = np.random.RandomState(0)
    torch.save({FORMAT_KEY: 1, **state}, path)


def test_an_old_format_file_is_refused_saying_why_and_loads_with_trusted(make_net, classification, tmp_path):
    x, y = classification
    first = easyfit.Model(make_net(), "cross_entropy", "sgd", lr=0.1)
    first.fit(x, y, epochs=1, batch_size=16, shuffle=False, verbose=0, callbacks=[EarlyStopping(monitor="loss")])
    old = tmp_path / "old.pt"
    _old_format_file(first, old)
    with pytest.raises(UntrustedCheckpointError, match=r"holds more than data \(.*numpy.*\).*Model\.load\(path, net, "
                                                       r"trusted=True\)"):
        easyfit.Model.load(old, net=make_net(seed=1))
    restored = easyfit.Model.load(old, net=make_net(seed=1), trusted=True)
    torch.testing.assert_close(restored.net.state_dict(), first.net.state_dict(), rtol=0, atol=0)
    assert restored.history.history["loss"] == pytest.approx(first.history.history["loss"])
    weights = easyfit.Model(make_net(seed=1), "cross_entropy", "sgd")
    weights.load_weights(old, trusted=True)
    torch.testing.assert_close(weights.net.state_dict(), first.net.state_dict(), rtol=0, atol=0)

    # converted once, trusted, it is data, and fit(resume_from=...) continues it exactly
    new = tmp_path / "new.pt"
    convert_checkpoint(old, new, trusted=True)
    converted = torch.load(new, weights_only=True)
    assert type(converted["history"]["history"]["loss"][0]) is float
    assert converted["powersgd_rng"]["key"].dtype == torch.int64
    resumed = easyfit.Model(make_net(seed=1), "cross_entropy", "sgd", lr=0.1)
    resumed.fit(x, y, epochs=2, batch_size=16, shuffle=False, verbose=0, resume_from=str(new),
                callbacks=[EarlyStopping(monitor="loss")])
    straight = easyfit.Model(make_net(), "cross_entropy", "sgd", lr=0.1)
    straight.fit(x, y, epochs=2, batch_size=16, shuffle=False, verbose=0)
    assert resumed.history.history["loss"] == pytest.approx(straight.history.history["loss"], abs=1e-6)
    torch.testing.assert_close(resumed.net.state_dict(), straight.net.state_dict(), rtol=0, atol=1e-6)


# --- what easyfit writes --------------------------------------------------------------------------------------
class NumpyState(Callback):
    """A callback whose state holds numpy values, as a user's may."""

    def __init__(self):
        self.best, self.seen = np.float64(np.inf), np.zeros(2)

    def on_epoch_end(self, epoch, logs=None):
        self.best, self.seen = np.float64(logs["loss"]), self.seen + 1

    def state_dict(self):
        return {"best": self.best, "seen": self.seen}

    def load_state_dict(self, state):
        self.best, self.seen = state["best"], state["seen"]


def test_every_file_easyfit_writes_loads_as_data(make_net, classification, tmp_path):
    x, y = classification
    model = easyfit.Model(make_net(dropout=0.1), "cross_entropy", "adam", metrics=["accuracy"],
                          scheduler=lambda optimizer: torch.optim.lr_scheduler.StepLR(optimizer, 1))
    callback = NumpyState()
    model.fit(x, y, epochs=2, batch_size=16, verbose=0, validation_split=0.2,
              callbacks=[callback, EarlyStopping(), ModelCheckpoint(str(tmp_path / "mid-{batch}.pt"), save_freq=3),
                         ModelCheckpoint(str(tmp_path / "w-{epoch}.pt"), save_weights_only=True),
                         BackupAndRestore(tmp_path / "backup", delete_checkpoint=False)])
    model.save(tmp_path / "saved.pt")
    files = sorted(tmp_path.rglob("*.pt"))
    assert len(files) >= 5
    for path in files:
        torch.load(path, weights_only=True)
    state = torch.load(tmp_path / "saved.pt", weights_only=True)
    assert state["callbacks"]["NumpyState"] == {"best": pytest.approx(float(callback.best)),
                                                "seen": pytest.approx(torch.tensor([2.0, 2.0], dtype=torch.float64))}
    assert state["rng"].dtype == torch.uint8
    resumed, again = easyfit.Model(make_net(dropout=0.1), "cross_entropy", "adam", metrics=["accuracy"]), NumpyState()
    resumed.fit(x, y, epochs=3, batch_size=16, verbose=0, validation_split=0.2, resume_from=str(tmp_path / "saved.pt"),
                callbacks=[again])
    assert resumed.completed_epochs == 3 and again.seen.tolist() == [3.0, 3.0]


class ObjectState(Callback):
    def state_dict(self):
        return {"thing": object()}


def test_a_state_that_is_not_data_is_refused_when_written_naming_where_it_is(make_net, tmp_path):
    model = easyfit.Model(make_net(), "cross_entropy", "sgd")
    model._callbacks.callbacks.append(ObjectState())
    with pytest.raises(TypeError, match=r"\['callbacks'\]\['ObjectState'\]\['thing'\] is a builtins\.object: a "
                                        r"checkpoint holds data only"):
        model.save(tmp_path / "saved.pt")
    assert not list(tmp_path.iterdir())


def test_as_data_converts_numpy_keeps_state_dict_metadata_and_copies_nothing_plain():
    net = nn.BatchNorm1d(3)
    state = net.state_dict()
    assert as_data(state) is state
    mixed = OrderedDict(state, extra=np.float32(2.5))
    mixed._metadata = state._metadata
    converted = as_data({"net": mixed, "array": np.arange(3), "pair": (np.int64(1), "a")})
    assert converted["net"]._metadata == state._metadata and type(converted["net"]["extra"]) is float
    assert torch.equal(converted["array"], torch.arange(3)) and converted["pair"] == (1, "a")
    with pytest.raises(TypeError, match=r"the checkpoint\['x'\]\[0\] is a numpy.ndarray"):
        as_data({"x": [np.array([object()])]})


def test_a_numpy_generator_state_is_data_and_draws_the_same_numbers():
    """PowerSGD's generator, saved by DDP with a PowerSGD hook."""
    rng = np.random.RandomState(3)
    rng.standard_normal(5)   # a cached gaussian too
    saved = as_data(numpy_generator_state(rng))
    assert saved is not None and all(type(value) in (str, int, float, torch.Tensor) for value in saved.values())
    again = numpy_generator(saved)
    assert np.array_equal(again.standard_normal(7), rng.standard_normal(7))
    assert numpy_generator(rng) is rng   # an old file's RandomState, loaded trusted


# --- issue 25: a failed load_weights changes nothing -----------------------------------------------------------
def test_load_weights_of_another_width_changes_nothing(tmp_path):
    narrow = easyfit.Model(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 8)), "mse", "sgd")
    narrow.save_weights(tmp_path / "narrow.pt")
    torch.manual_seed(1)
    wide = easyfit.Model(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 16)), "mse", "sgd")
    before = {name: value.clone() for name, value in wide.net.state_dict().items()}
    with pytest.raises(ValueError, match=r"do not fit this net, which is left unchanged \(1\.weight: the net has "
                                         r"\(16, 4\), the file \(8, 4\); 1\.bias"):
        wide.load_weights(tmp_path / "narrow.pt")
    torch.testing.assert_close(wide.net.state_dict(), before, rtol=0, atol=0)   # layer 0 fits, yet is unchanged


# --- issue 25: model.save holds the device random state a ModelCheckpoint file holds ------------------------------
class DeviceRngStrategy(SingleDeviceStrategy):
    """One CPU device with a device generator of its own, as XLA's: its state is a number the test sets."""

    def __init__(self):
        super().__init__()
        self.seed, self.loaded = 1234, []

    def device_rng_state(self) -> dict:
        return {"xla_rng": self.seed}

    def load_device_rng_state(self, state: dict) -> None:
        self.loaded.append(state.get("xla_rng"))


@pytest.mark.filterwarnings("ignore:resuming. no callback")
def test_model_save_after_fit_holds_the_device_random_state_as_modelcheckpoint_does(make_net, classification,
                                                                                     tmp_path):
    x, y = classification
    strategy = DeviceRngStrategy()
    model = easyfit.Model(make_net(), "cross_entropy", "sgd")
    model.fit(x, y, epochs=1, verbose=0, strategy=strategy, callbacks=[ModelCheckpoint(str(tmp_path / "during.pt"))])
    model.strategy.seed = 99   # the device generator of the strategy the fit ran (a copy of the one given) moved on
    model.save(tmp_path / "after.pt")
    assert torch.load(tmp_path / "during.pt", weights_only=True)["xla_rng"] == 1234
    assert torch.load(tmp_path / "after.pt", weights_only=True)["xla_rng"] == 99
    resumed = DeviceRngStrategy()
    easyfit.Model(make_net(), "cross_entropy", "sgd").fit(x, y, epochs=2, verbose=0, strategy=resumed,
                                                          resume_from=str(tmp_path / "after.pt"))
    assert resumed.loaded == [99]


# --- only the launchers' own exchanges unpickle ----------------------------------------------------------------
#: (module, function) -> why it may unpickle: the processes of one run, through a folder or pipe no user names
OWN_PICKLES = {
    ("distributed/launchers/spawn.py", "read_result"): "rank 0's result, from the call's private mkdtemp folder",
    ("distributed/launchers/spawn.py", "run"): "the work the caller pickled for its spawned ranks",
    ("distributed/launchers/xla.py", "run"): "the work the caller pickled for torch_xla's replicas",
    ("distributed/attempt_start.py", "put_back"): "the callbacks' attributes this process pickled in memory",
}


def unpickles(call: ast.Call) -> bool:
    """A pickle.load(s) call, or torch.load(..., weights_only=False)."""
    function = call.func
    if not (isinstance(function, ast.Attribute) and isinstance(function.value, ast.Name)):
        return False
    name = (function.value.id, function.attr)
    unsafe = any(keyword.arg == "weights_only" and isinstance(keyword.value, ast.Constant)
                 and keyword.value.value is False for keyword in call.keywords)
    return name in (("pickle", "load"), ("pickle", "loads")) or (name == ("torch", "load") and unsafe)


def _unpickling_calls() -> set[tuple[str, str]]:
    """(module, enclosing function) of every call in easyfit that unpickles whatever a file holds."""
    return {(module, function) for module, function, _ in calls_in_easyfit(unpickles)}


def test_only_the_launchers_own_exchanges_unpickle():
    assert _unpickling_calls() == set(OWN_PICKLES)


def test_a_truncated_file_is_refused_naming_it_and_what_is_wrong(tmp_path):
    model = easyfit.Model(nn.Linear(40, 30))
    model.save_weights(tmp_path / "whole.pt")
    model.save(tmp_path / "checkpoint.pt")
    for name, keep in (("whole.pt", 0.5), ("whole.pt", 0.0), ("checkpoint.pt", 0.5)):
        data = (tmp_path / name).read_bytes()
        cut = tmp_path / f"cut-{keep}-{name}"
        cut.write_bytes(data[:int(len(data) * keep)])
        what = "it is empty" if keep == 0 else f"its {int(len(data) * keep)} bytes are cut short or damaged"
        with pytest.raises(DamagedFileError, match=rf"^'{cut}' cannot be read: {what}.*copy or write it again"):
            model.load_weights(cut)
        with pytest.raises(DamagedFileError, match=rf"^'{cut}' cannot be read"):
            easyfit.Model.load(cut, nn.Linear(40, 30))


KILLED_SAVE = """
import os, signal, sys, torch, easyfit
def stop_half_way(obj, path):
    with open(path, "wb") as file:
        file.write(b"PK" * 1000)
        file.flush()
    os.kill(os.getpid(), signal.SIGKILL)
torch.save = stop_half_way
easyfit.Model(torch.nn.Linear(4, 1)).save(sys.argv[1])
"""


def test_what_a_killed_save_leaves_is_removed_by_the_next_save_or_load(tmp_path):
    """Only easyfit's temporary files of that target, of a writer that has ended, are removed."""
    path = tmp_path / "model.pt"
    easyfit.Model(nn.Linear(4, 1)).save(path)
    killed = subprocess.Popen([sys.executable, "-c", KILLED_SAVE, str(path)], stderr=subprocess.PIPE)
    assert killed.wait(timeout=120) == -9, killed.stderr.read().decode()[-2000:]
    leftover = [name for name in os.listdir(tmp_path) if name != "model.pt"]
    assert leftover == [temp_prefix(str(path), killed.pid) + leftover[0][-11:]] and leftover[0].endswith(".pt")
    leftover = tmp_path / leftover[0]
    kept = [tmp_path / (temp_prefix(str(path), os.getppid()) + "abcd1234.pt"),   # its writer still runs
            tmp_path / (temp_prefix(str(tmp_path / "other.pt"), killed.pid) + "abcd1234.pt"),   # another target's
            tmp_path / ".tmp-abcd1234.pt"]   # not named as easyfit names its own
    for file in kept:
        file.write_bytes(b"")
    copy = leftover.read_bytes()
    easyfit.Model.load(path, nn.Linear(4, 1))   # a load: the old file is whole, the leftover removed
    assert not leftover.exists() and all(file.exists() for file in kept)
    leftover.write_bytes(copy)
    easyfit.Model(nn.Linear(4, 1)).save_weights(path)   # a save
    assert not leftover.exists() and all(file.exists() for file in kept)


def _process_state(pid: int) -> str:
    """The state letter Linux's /proc gives process `pid` ("Z": ended, not reaped yet)."""
    return pathlib.Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="an unreaped process is told by Linux's /proc")
def test_a_killed_writer_its_parent_has_not_reaped_counts_as_ended(tmp_path):
    """A writer killed mid-save that its parent has not waited for yet (a zombie, as a rank whose caller was killed
    too) keeps its process id in use: its temporary file is still removed by the next load, as an ended writer's
    (it was kept, as a running one's)."""
    path = tmp_path / "model.pt"
    easyfit.Model(nn.Linear(4, 1)).save(path)
    killed = subprocess.Popen([sys.executable, "-c", KILLED_SAVE, str(path)], stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while _process_state(killed.pid) != "Z":   # this test waits for it only after the load
            assert time.monotonic() < deadline, "the writer did not end"
            time.sleep(0.05)
        (leftover,) = [name for name in os.listdir(tmp_path) if name != "model.pt"]
        easyfit.Model.load(path, nn.Linear(4, 1))
        assert not (tmp_path / leftover).exists()
        assert killed.wait(timeout=30) == -9   # it was killed mid-save, as KILLED_SAVE does
    finally:
        if killed.poll() is None:   # a writer that never ended: stopped, not left behind
            killed.kill()
            killed.wait(timeout=30)
