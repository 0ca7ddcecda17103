"""strategy="xla" on XLA:CPU (PJRT_DEVICE=CPU): the same numbers as plain PyTorch on the CPU, checkpoints a plain
CPU net loads, an exact resume, and no graph compiled after the first epoch.

These run where torch_xla is installed: in CI, in the environment scripts/install_xla.sh builds
("$(scripts/install_xla.sh --print-python)" -m pytest tests/xla); elsewhere they are skipped.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

os.environ.setdefault("PJRT_DEVICE", "CPU")
pytest.importorskip("torch_xla", reason="torch_xla is not installed: build its environment with "
                                        "scripts/install_xla.sh (see docs/tpu.md)")
import torch_xla
import torch_xla.debug.metrics as met

torch_xla.device()   # XLA's runtime starts before the first backward here (see docs/tpu.md, "Known limits")

from xla_common import ACCUMULATE, BATCH, CLIP, LR, TOLERANCE, data, largest_difference, net, plain_pytorch

import easyfit
from easyfit.callbacks import Callback, ModelCheckpoint
from easyfit.callbacks.progress import ProgressBar

XLA_RUN = {"accelerator": "tpu", "devices": 1, "verbose": 0}
SOURCE = str(Path(easyfit.__file__).parents[1])   # the easyfit under test, for the launched scripts


def xla_fit(optimizer_name: str, epochs: int = 2, metrics=None, **options) -> easyfit.Model:
    model = easyfit.Model(net(), "cross_entropy", optimizer_name.lower(), metrics, lr=LR)
    model.fit(*data(), epochs=epochs, batch_size=BATCH, shuffle=False, gradient_accumulation_steps=ACCUMULATE,
              gradient_clip_val=CLIP, **XLA_RUN, **options)
    return model


class GraphCounts(Callback):
    """XLA's graph compilations and device-to-host transfers so far, at the end of every epoch."""

    def __init__(self):
        self.compilations, self.transfers = [], []

    def on_epoch_end(self, epoch, logs=None):
        self.compilations.append(_samples("CompileTime"))
        self.transfers.append(_samples("TransferFromDeviceTime"))


def _samples(metric: str) -> int:
    data = met.metric_data(metric)
    return data[0] if data else 0


@pytest.mark.parametrize("optimizer_name", ["SGD", "Adam"])
def test_one_xla_device_trains_as_plain_pytorch_on_the_cpu(optimizer_name):
    model = xla_fit(optimizer_name)
    assert all(p.device.type == "cpu" for p in model.net.parameters())   # handed back on the CPU
    assert largest_difference(model.net, plain_pytorch(optimizer_name)) < TOLERANCE


@pytest.mark.parametrize("metrics, bar", [(None, False), (["accuracy"], False), (None, True)])
def test_no_graph_is_compiled_after_the_first_epoch(metrics, bar, capsys):
    """Every step reuses its compiled graph, with metrics too; a progress bar reading the running loss after every
    step adds reads, not graphs."""
    counts = GraphCounts()
    xla_fit("SGD", epochs=3, callbacks=[counts, *([ProgressBar(refresh_seconds=0)] if bar else [])], metrics=metrics)
    compiled, transfers = counts.compilations, counts.transfers
    steps = -(-101 // BATCH)
    with capsys.disabled():
        print(f"\nmetrics={metrics}, progress bar={bar}: XLA graph compilations at the end of epochs 1-3: {compiled} "
              f"(after epoch 1: {compiled[-1] - compiled[0]}); device-to-host transfers in epochs 2 and 3: "
              f"{[b - a for a, b in zip(transfers, transfers[1:])]}, for {steps} steps each")
    assert compiled[-1] == compiled[0]
    reads = 1 + bool(metrics) + (steps if bar else 0)   # the epoch's loss and its metric (and the bar's reads)
    assert all(b - a == reads for a, b in zip(transfers, transfers[1:]))


def test_evaluate_and_predict_equal_plain_pytorch():
    model = easyfit.Model(net(), "cross_entropy", "sgd", metrics=["accuracy"])
    x, y = data()
    plain = net()
    with torch.no_grad():
        outputs = plain(x)
    expected_loss = nn.functional.cross_entropy(outputs, y).item()
    expected_accuracy = (outputs.argmax(1) == y).float().mean().item()
    loss, accuracy = model.evaluate(x, y, batch_size=BATCH, **XLA_RUN)
    assert loss == pytest.approx(expected_loss, abs=TOLERANCE)
    assert accuracy == pytest.approx(expected_accuracy, abs=1e-7)
    predictions = model.predict(x, batch_size=BATCH, **XLA_RUN)
    assert predictions.device.type == "cpu" and predictions.shape == (101, 3)
    assert (predictions - outputs).abs().max().item() < TOLERANCE


def test_what_the_first_step_conforms_reaches_the_batches_the_loader_reads_ahead():
    """Labels of shape (N, 1) in int32: the first step flattens them and makes them int64 for every later batch."""
    x, y = data()
    model = easyfit.Model(net(), "cross_entropy", "sgd", lr=LR)
    model.fit(x, y.view(-1, 1).int(), epochs=2, batch_size=BATCH, shuffle=False, **XLA_RUN)
    plain = easyfit.Model(net(), "cross_entropy", "sgd", lr=LR)
    plain.fit(x, y, epochs=2, batch_size=BATCH, shuffle=False, **XLA_RUN)
    assert largest_difference(model.net, plain.net) == 0.0


def test_checkpoints_hold_cpu_tensors_that_a_plain_net_loads(tmp_path):
    model = xla_fit("Adam", epochs=1, callbacks=[ModelCheckpoint(str(tmp_path / "during.pt"))])
    model.save(tmp_path / "after.pt")
    for name in ("during.pt", "after.pt"):
        state = torch.load(tmp_path / name, map_location=None, weights_only=True)
        tensors = [*state["net"].values(), *[v for s in state["optimizer"]["state"].values() for v in s.values()]]
        assert all(tensor.device.type == "cpu" for tensor in tensors), name
        plain = net()
        plain.load_state_dict(state["net"])
        assert largest_difference(plain, model.net) == 0.0, name


def test_resume_continues_exactly(tmp_path):
    straight = xla_fit("Adam", epochs=2)
    first = xla_fit("Adam", epochs=1, callbacks=[ModelCheckpoint(str(tmp_path / "epoch1.pt"))])
    resumed = easyfit.Model(net(), "cross_entropy", "adam", lr=LR)
    resumed.fit(*data(), epochs=2, batch_size=BATCH, shuffle=False, gradient_accumulation_steps=ACCUMULATE,
                gradient_clip_val=CLIP, resume_from=str(tmp_path / "epoch1.pt"), **XLA_RUN)
    assert first.completed_epochs == 1 and resumed.completed_epochs == 2
    assert largest_difference(resumed.net, straight.net) == 0.0


def test_bf16_mixed_computes_in_bfloat16_close_to_float32():
    model = easyfit.Model(net(), "cross_entropy", "sgd", lr=LR)
    dtypes = set()
    model.net[0].register_forward_hook(lambda module, inputs, output: dtypes.add(output.dtype))
    model.fit(*data(), epochs=2, batch_size=BATCH, shuffle=False, gradient_accumulation_steps=ACCUMULATE,
              gradient_clip_val=CLIP, precision="bf16-mixed", **XLA_RUN)
    assert dtypes == {torch.bfloat16}
    assert largest_difference(model.net, plain_pytorch("SGD")) < 2e-2


def test_several_xla_cpu_devices_are_refused_in_words(monkeypatch):
    monkeypatch.setenv("CPU_NUM_DEVICES", "2")
    model = easyfit.Model(net(), "cross_entropy", "sgd")
    with pytest.raises(ValueError, match="several XLA:CPU devices .* pytorch/xla issue 9089"):
        model.fit(*data(), epochs=1, accelerator="tpu", devices="auto", verbose=0)


def test_float16_mixed_is_refused_with_bf16_named():
    model = easyfit.Model(net(), "cross_entropy", "sgd")
    with pytest.raises(ValueError, match="bf16-mixed"):
        model.fit(*data(), epochs=1, precision="16-mixed", **XLA_RUN)


def test_auto_on_tpu_and_a_strategy_object_are_xla():
    from easyfit.distributed.connector import connect
    strategy = connect(accelerator="tpu", devices=1)
    assert strategy.name == "xla" and strategy.make_launcher() is None
    given = easyfit.strategies.XLA()
    configured = connect(strategy=given, devices=1)
    # the call configures a copy: the user's object stays as made, ready for another call
    assert type(configured) is type(given) and configured is not given and configured.make_launcher() is None
    assert type(connect(strategy=easyfit.strategies.XLA(), devices=-1).make_launcher()).__name__ == "XLALauncher"


def test_every_device_is_started_by_torch_xla_launch_and_rank_zero_state_comes_back(tmp_path):
    """devices=-1: one process per XLA device (one on XLA:CPU), started by torch_xla.launch; then a failing one."""
    script = Path(__file__).parent / "launch_fit.py"
    environment = {**os.environ, "PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "1",
                   "PYTHONPATH": os.pathsep.join([SOURCE, os.environ.get("PYTHONPATH", "")])}
    process = subprocess.run([sys.executable, str(script), str(tmp_path)], capture_output=True, text=True,
                             timeout=240, env=environment)
    result = torch.load(tmp_path / "result.pt", weights_only=False)
    trained = net()
    trained.load_state_dict(result["net"])
    assert result["devices"] == {"cpu"} and len(result["loss"]) == 2
    assert largest_difference(trained, plain_pytorch("Adam")) < TOLERANCE
    # the second fit's process raised: the caller gets its error and traceback
    assert process.returncode != 0 and "RankFailedError: rank 0 failed" in process.stderr
    assert "this net's forward fails in the launched process" in process.stderr


def test_an_xla_fit_assigns_nothing_on_its_strategy_and_only_results_on_the_model(monkeypatch):
    """The XLA leg of tests/distributed/test_strategy_state.py: two fits record every attribute assigned on the
    configured strategy object (none) and on the Model (the running call's object and the documented results)."""
    import importlib.util

    import easyfit.model
    spec = importlib.util.spec_from_file_location(
        "strategy_state", Path(__file__).parents[1] / "distributed" / "scripts" / "strategy_state.py")
    state = importlib.util.module_from_spec(spec)
    monkeypatch.syspath_prepend(str(Path(__file__).parents[1] / "distributed" / "scripts"))
    spec.loader.exec_module(state)
    found: dict = {}
    monkeypatch.setattr(easyfit.model, "call_on_rank", state.recording(easyfit.model.call_on_rank, found))
    for _ in range(2):
        xla_fit("SGD", epochs=1)
    fits = found["xla"]
    assert [(fit["assigned"], fit["added"], fit["removed"], fit["changed"]) for fit in fits] == [([], [], [], [])] * 2
    assert all(set(fit["model"]) <= state.MODEL_RESULTS for fit in fits), fits
