"""The accelerator and device table: every row, every error and what its message says."""
from __future__ import annotations

import inspect
import os
import subprocess
import sys
import types

import numpy as np
import pytest
import torch

from easyfit.distributed import devices as devices_module
from easyfit.distributed.devices import device_count, is_interactive, parse_devices, resolve_accelerator

CPU = torch.device("cpu")


@pytest.fixture
def gpus(monkeypatch):
    """Pretend this machine has `n` CUDA devices (the dispatch logic only; nothing runs on them)."""
    def make(n: int) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
    return make


def cuda(*ids: int) -> list[torch.device]:
    return [torch.device("cuda", index) for index in ids]


@pytest.mark.parametrize("devices, interactive, expected", [
    (3, False, ("cuda", cuda(0, 1, 2))),
    ("3", False, ("cuda", cuda(0, 1, 2))),
    (np.int64(2), False, ("cuda", cuda(0, 1))),
    (1, False, ("cuda", cuda(0))),
    (-1, False, ("cuda", cuda(0, 1, 2, 3))),
    ("-1", False, ("cuda", cuda(0, 1, 2, 3))),
    ([1, 3], False, ("cuda", cuda(1, 3))),
    ((3, 1), False, ("cuda", cuda(3, 1))),
    ([0], False, ("cuda", cuda(0))),
    ("1, 3", False, ("cuda", cuda(1, 3))),
    ("1,3", False, ("cuda", cuda(1, 3))),
    (" 0 , 2 ", False, ("cuda", cuda(0, 2))),
    ("auto", False, ("cuda", cuda(0, 1, 2, 3))),
    (" AUTO ", False, ("cuda", cuda(0, 1, 2, 3))),
    ("auto", True, ("cuda", cuda(0))),
    (0, False, ("cpu", [CPU])),
    ("0", False, ("cpu", [CPU])),
    ([], False, ("cpu", [CPU])),
    (None, False, ("cpu", [CPU])),
])
def test_cuda_table(gpus, devices, interactive, expected):
    gpus(4)
    assert parse_devices(devices, "cuda", interactive=interactive) == expected


@pytest.mark.parametrize("devices, interactive, processes", [
    (2, False, 2), ("2", False, 2), (1, False, 1), (64, False, 64), (-1, False, 8), ("-1", False, 8),
    ("auto", False, 1), ("auto", True, 1), (0, False, 1), ("0", False, 1), ([], False, 1), (None, False, 1),
])
def test_cpu_table_counts_processes(monkeypatch, devices, interactive, processes):
    monkeypatch.setattr(os, "cpu_count", lambda: 8)
    assert parse_devices(devices, "cpu", interactive=interactive) == ("cpu", [CPU] * processes)


@pytest.mark.parametrize("devices, expected", [(1, [torch.device("mps", 0)]), ("auto", [torch.device("mps", 0)]),
                                               (-1, [torch.device("mps", 0)]), (0, [CPU])])
def test_mps_table(devices, expected):
    assert parse_devices(devices, "mps", interactive=False)[1] == expected


def test_auto_asks_is_interactive_when_not_told(gpus, monkeypatch):
    gpus(2)
    monkeypatch.setattr(sys, "ps1", ">>> ", raising=False)
    assert parse_devices("auto", "cuda") == ("cuda", cuda(0))
    monkeypatch.delattr(sys, "ps1")
    assert parse_devices("auto", "cuda") == ("cuda", cuda(0, 1))


@pytest.mark.parametrize("devices, message", [
    ([0, 5], "devices=[0, 5]: this machine has 2 CUDA devices (0, 1), so there is no device 5."),
    ("0, 5", "devices='0, 5': this machine has 2 CUDA devices (0, 1), so there is no device 5."),
    (3, "devices=3: this machine has 2 CUDA devices (0, 1); pass devices=2 or -1 for all of them."),
    ("3", "devices='3': this machine has 2 CUDA devices (0, 1); pass devices=2 or -1 for all of them."),
    ([1, 1], "devices=[1, 1]: device 1 is listed more than once; list each device once "
             "(this machine has 2 CUDA devices (0, 1))."),
    ([-1, 0], "devices=[-1, 0]: device ids cannot be negative (-1); -1 alone means all devices, "
              "and this machine has 2 CUDA devices (0, 1)."),
    (-2, "devices=-2: a count must be >= 1, or -1 for all devices, or 0 for CPU."),
    ("-2", "devices='-2': a count must be >= 1, or -1 for all devices, or 0 for CPU."),
    (True, "devices=True: a bool is not a device choice"),
    (False, "devices=False: a bool is not a device choice"),
    (1.0, "devices=1.0 (float) is not understood"),
    (2.5, "devices=2.5 (float) is not understood"),
    ({0, 1}, "(set) is not understood"),
    (["0", "1"], "a list must hold integer device ids"),
    ([0, True], "a list must hold integer device ids"),
    ("abc", "devices='abc' is not understood. Pass a count"),
    ("atuo", "devices='atuo' is not understood. Did you mean 'auto'?"),
    ("", "devices='' is not understood"),
    ("1,", "devices='1,' is not understood"),
    ("1,,2", "devices='1,,2' is not understood"),
    ("--1", "devices='--1' is not understood"),
    ("1.5", "devices='1.5' is not understood"),
])
def test_cuda_errors_name_what_exists(gpus, devices, message):
    gpus(2)
    with pytest.raises(ValueError) as error:
        parse_devices(devices, "cuda", interactive=False)
    assert message in str(error.value)


def test_one_device_is_named_in_the_singular(gpus):
    gpus(1)
    with pytest.raises(ValueError, match=r"devices=2: this machine has 1 CUDA device \(0\); pass devices=1"):
        parse_devices(2, "cuda", interactive=False)


def test_no_cuda_device_at_all_suggests_cpu(gpus):
    gpus(0)
    with pytest.raises(ValueError, match="devices=-1: this machine has 0 CUDA devices; use accelerator='cpu'"):
        parse_devices(-1, "cuda", interactive=False)


def test_mps_has_one_device():
    with pytest.raises(ValueError, match=r"devices=2: this machine has 1 MPS device \(0\)"):
        parse_devices(2, "mps", interactive=False)


@pytest.mark.parametrize("devices", [[0, 1], "0,1", (0,)])
def test_cpu_rejects_device_ids(devices):
    with pytest.raises(ValueError, match="on CPU devices=N is a number of processes: pass devices="):
        parse_devices(devices, "cpu", interactive=False)


@pytest.mark.parametrize("devices", [-2, "-5", True, 1.5, "two"])
def test_cpu_rejects_what_is_not_a_count(devices):
    with pytest.raises(ValueError, match=r"devices="):
        parse_devices(devices, "cpu", interactive=False)


@pytest.mark.parametrize("accelerator", ["gpu", "auto"])
def test_parse_devices_needs_a_resolved_accelerator(accelerator):
    with pytest.raises(ValueError, match="resolve_accelerator"):
        parse_devices(1, accelerator)


@pytest.mark.parametrize("cuda_ok, mps_ok, expected", [(True, True, "cuda"), (True, False, "cuda"),
                                                        (False, True, "mps"), (False, False, "cpu")])
def test_auto_accelerator_prefers_cuda_then_mps(monkeypatch, cuda_ok, mps_ok, expected):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda_ok)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: mps_ok)
    assert resolve_accelerator("auto") == expected
    assert resolve_accelerator("AUTO") == expected


@pytest.mark.parametrize("name, expected", [("gpu", "cuda"), ("GPU", "cuda"), ("cuda", "cuda"), ("cpu", "cpu")])
def test_named_accelerators(gpus, name, expected):
    gpus(1)
    assert resolve_accelerator(name) == expected


def test_mps_when_available(monkeypatch):
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: True)
    assert resolve_accelerator("mps") == "mps"


@pytest.mark.parametrize("name", ["gpu", "cuda"])
def test_gpu_without_cuda_says_what_torch_sees(gpus, monkeypatch, name):
    gpus(0)
    monkeypatch.setattr(torch.version, "cuda", None)
    with pytest.raises(RuntimeError) as error:
        resolve_accelerator(name)
    text = str(error.value)
    assert f"accelerator={name!r}" in text and f"torch build ({torch.__version__}) has no CUDA support" in text
    assert "accelerator='cpu'" in text and "'auto'" in text


def test_gpu_hidden_by_cuda_visible_devices_is_named(gpus, monkeypatch):
    gpus(0)
    monkeypatch.setattr(torch.version, "cuda", "12.1")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    with pytest.raises(RuntimeError, match=r"built for CUDA 12.1\) finds no usable GPU with CUDA_VISIBLE_DEVICES=''"):
        resolve_accelerator("gpu")


def test_mps_missing_is_an_error(monkeypatch):
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match="accelerator='mps'.*Use accelerator='cpu' or 'auto'"):
        resolve_accelerator("mps")


@pytest.mark.parametrize("name, hint", [("gpus", "Did you mean 'gpu'?"), ("cdua", "Did you mean 'cuda'?"),
                                        ("ipu", "Valid values: auto, cpu, gpu, cuda, mps, tpu.")])
def test_unknown_accelerator(name, hint):
    with pytest.raises(ValueError, match=f"unknown accelerator {name!r}") as error:
        resolve_accelerator(name)
    assert hint in str(error.value) and "Valid values: auto, cpu, gpu, cuda, mps, tpu." in str(error.value)


def test_device_count(gpus, monkeypatch):
    gpus(3)
    monkeypatch.setattr(os, "cpu_count", lambda: 6)
    assert (device_count("cuda"), device_count("mps"), device_count("cpu")) == (3, 1, 6)
    monkeypatch.setattr(os, "cpu_count", lambda: None)
    assert device_count("cpu") == 1
    with pytest.raises(ValueError, match="resolved accelerator"):
        device_count("gpu")


def test_is_interactive_follows_the_interpreter(monkeypatch):
    script = types.ModuleType("__main__")
    script.__file__ = "train.py"
    monkeypatch.setitem(sys.modules, "__main__", script)
    monkeypatch.delattr(sys, "ps1", raising=False)
    assert not is_interactive()
    monkeypatch.setattr(sys, "ps1", ">>> ", raising=False)
    assert is_interactive()
    monkeypatch.delattr(sys, "ps1")
    monkeypatch.setattr(sys, "flags", types.SimpleNamespace(interactive=1))
    assert is_interactive()
    monkeypatch.undo()
    monkeypatch.setitem(sys.modules, "__main__", types.ModuleType("__main__"))  # a notebook kernel's __main__
    assert is_interactive()


@pytest.mark.timeout(60)
def test_is_interactive_in_real_interpreters(tmp_path):
    """The function's own source, run by a script and by a REPL (without importing torch, to stay fast)."""
    script = tmp_path / "train.py"
    script.write_text(f"import sys\n{inspect.getsource(is_interactive)}\nprint(is_interactive())\n")
    from_file = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=50)
    from_repl = subprocess.run([sys.executable, "-i", "-q"], input=script.read_text() + "\n", capture_output=True,
                               text=True, timeout=50)
    assert from_file.stdout.strip() == "False", from_file.stderr
    assert from_repl.stdout.strip() == "True", from_repl.stderr


# --- auto-selecting GPUs ------------------------------------------------------------------
@pytest.fixture
def probed(monkeypatch, gpus):
    """Pretend the probe found device 0 refusing work (exclusive mode, busy) and devices 1, 2 and 3 usable."""
    answer = {0: "CUDA error: all CUDA-capable devices are busy or unavailable", 1: None, 2: None, 3: None}
    gpus(4)
    monkeypatch.setattr(devices_module, "probe_cuda_devices", lambda: answer)


def test_auto_select_takes_usable_devices_only(probed):
    assert parse_devices(2, "cuda", auto_select=True) == ("cuda", cuda(1, 2))
    assert parse_devices("auto_select", "cuda") == ("cuda", cuda(1, 2, 3))
    assert parse_devices(-1, "cuda", auto_select=True) == ("cuda", cuda(1, 2, 3))
    assert devices_module.find_usable_cuda_devices(3) == [1, 2, 3]


def test_auto_select_says_why_when_too_few_devices_take_work(probed):
    with pytest.raises(RuntimeError, match=r"4 usable CUDA device\(s\) wanted, 3 of the 4 visible take work "
                                           r"\(device 0: CUDA error: all CUDA-capable devices are busy"):
        parse_devices(4, "cuda", auto_select=True)
    with pytest.raises(ValueError, match=r"picks the devices itself, but devices=\[0, 1\] names them"):
        parse_devices([0, 1], "cuda", auto_select=True)
    with pytest.raises(ValueError, match=r"picks CUDA devices, but this call runs on 'cpu'"):
        parse_devices("auto_select", "cpu")


def test_the_summary_line_names_the_auto_selected_devices(probed):
    from easyfit.distributed.connector import connect
    from easyfit.parts.lr_scaling import describe
    strategy = connect("ddp", devices=2, accelerator="gpu", auto_select_gpus=True)
    assert [device.index for device in strategy.parallel_devices] == [1, 2]
    optimizer = torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=0.1)
    assert describe(8, strategy, "linear", optimizer, 2.0).startswith("auto-selected CUDA devices 1, 2; ")


def test_the_real_probe_runs_in_a_fresh_interpreter_and_is_kept_for_the_ranks(monkeypatch):
    monkeypatch.setenv(devices_module.PROBE_VARIABLE, "{}")
    monkeypatch.delenv(devices_module.PROBE_VARIABLE)   # restored (unset) after the test
    found = devices_module.probe_cuda_devices()
    assert len(found) == torch.cuda.device_count()
    assert os.environ[devices_module.PROBE_VARIABLE]   # the ranks this script starts inherit the answer
    if torch.cuda.device_count() == 0:
        with pytest.raises(RuntimeError, match="at least one usable CUDA device"):
            devices_module.find_usable_cuda_devices()
