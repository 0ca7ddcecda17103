"""TPU calls that cannot run say why before any training work: torch_xla missing or built for another torch,
a strategy that cannot drive XLA, devices torch_xla cannot take. These run with or without torch_xla."""
from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import easyfit
from easyfit.distributed.devices import parse_devices

HAS_TORCH_XLA = importlib.util.find_spec("torch_xla") is not None


def fit(**options) -> None:
    torch.manual_seed(0)
    model = easyfit.Model(nn.Linear(4, 2), "cross_entropy", "sgd")
    model.fit(torch.randn(8, 4), torch.zeros(8, dtype=torch.long), epochs=1, verbose=0, **options)


@pytest.mark.skipif(HAS_TORCH_XLA, reason="torch_xla is installed here")
@pytest.mark.parametrize("options", [{"accelerator": "tpu"}, {"strategy": "xla"}])
def test_missing_torch_xla_names_the_install_and_its_torch_pin(options):
    with pytest.raises(ImportError) as error:
        fit(**options)
    message = str(error.value)
    assert "torch_xla, which is not installed" in message and "pip install 'easyfit[xla]'" in message
    assert "requires torch 2.9" in message and torch.__version__ in message


def test_a_torch_xla_built_for_another_torch_is_named(monkeypatch):
    real_version = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version",
                        lambda name: "1.0.0" if name == "torch_xla" else real_version(name))
    with pytest.raises(RuntimeError, match=r"torch_xla 1\.0\.0 works only with torch 1\.0, but torch .* installed"):
        fit(accelerator="tpu", devices=1)


@pytest.mark.parametrize("strategy", ["ddp", "deepspeed", "fsdp", "horovod", "single"])
def test_strategies_that_cannot_drive_xla_are_refused_on_tpu(strategy):
    with pytest.raises(ValueError, match=f"strategy='{strategy}' cannot run on TPUs.*strategy='xla'"):
        fit(accelerator="tpu", strategy=strategy)


def test_xla_on_another_accelerator_is_refused():
    with pytest.raises(ValueError, match="strategy='xla' trains on torch_xla's device.*accelerator='tpu'"):
        fit(strategy="xla", accelerator="cpu")


@pytest.mark.parametrize("devices", [[0, 1], "0,1", 0])
def test_device_ids_on_tpu_are_refused(devices):
    with pytest.raises(ValueError, match="torch_xla chooses the devices itself"):
        fit(accelerator="tpu", devices=devices)


@pytest.mark.parametrize("devices, interactive, expected", [
    (1, False, ["xla:0"]),
    (8, False, [f"xla:{index}" for index in range(8)]),
    (-1, False, ["xla"]),   # every device of this host: torch_xla knows how many
    ("auto", False, ["xla"]),
    ("auto", True, ["xla:0"]),   # a notebook cannot start the per-device processes
])
def test_tpu_devices(devices, interactive, expected):
    accelerator, parsed = parse_devices(devices, "tpu", interactive=interactive)
    assert accelerator == "tpu" and [str(device) for device in parsed] == expected


def test_importing_easyfit_and_naming_the_strategy_import_no_torch_xla():
    code = ("import sys, easyfit, easyfit.strategies; easyfit.strategies.classes()['XLA']; "
            "from easyfit.distributed.strategies import xla; print('torch_xla' in sys.modules)")
    output = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120,
                            env={**os.environ, "PYTHONPATH": str(Path(easyfit.__file__).parents[1])}).stdout
    assert output.strip() == "False"
