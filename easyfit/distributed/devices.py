"""Which accelerator and which devices this node trains on: `accelerator=` and `devices=` in words.

| devices          | on CUDA / MPS                          | on CPU                                 |
|------------------|----------------------------------------|----------------------------------------|
| 3 or "3"         | the first 3 devices                    | 3 processes                            |
| -1 or "-1"       | every device                           | one process per core                   |
| [1, 3] or "1, 3" | devices 1 and 3                        | an error: on CPU devices=N is a count  |
| "auto"           | every device; 1 in a notebook or REPL  | 1 process                              |
| 0, "0", [], None | CPU, one process                       | one process                            |
| "auto_select"    | every CUDA device that takes work      | an error: it picks GPUs                |

`auto_select_gpus=True` with a count picks that many CUDA devices that take work (`find_usable_cuda_devices`).

A number is always a count ("3" included); only a list, or a string with a comma, names device ids.
On TPUs (accelerator="tpu", torch_xla) devices=1 is one device in this process; N, -1 and "auto" are every device of
this host, one process each (1 in a notebook or REPL); ids are an error, as torch_xla chooses the devices.
"""
from __future__ import annotations

import json
import numbers
import os
import re
import subprocess
import sys

import torch

from easyfit.utils.checks import closest_name

ACCELERATORS = ("auto", "cpu", "gpu", "cuda", "mps", "tpu")
RESOLVED = ("cpu", "cuda", "mps", "tpu")
LABELS = {"cuda": "CUDA", "mps": "MPS"}
FORMS = "a count (2), -1 for all, a list of ids ([0, 1]), a string ('2', '0,1', '-1'), 'auto' or 'auto_select'"


def resolve_accelerator(accelerator: str) -> str:
    """'auto' / 'gpu' / 'cuda' / 'mps' / 'cpu' / 'tpu' -> the accelerator this process uses: 'cuda', 'mps', 'cpu'
    or 'tpu' (torch_xla's device, checked when its strategy is built; 'auto' never picks it)."""
    key = str(accelerator).lower()
    if key not in ACCELERATORS:
        raise ValueError(f"unknown accelerator {accelerator!r}.{closest_name(key, ACCELERATORS)} "
                         f"Valid values: {', '.join(ACCELERATORS)}.")
    if key == "auto":
        if torch.cuda.is_available():
            return "cuda"
        return "mps" if torch.backends.mps.is_available() else "cpu"
    if key in ("gpu", "cuda") and not torch.cuda.is_available():
        raise RuntimeError(f"accelerator={accelerator!r} was asked for, but {_cuda_report()}. "
                           "Use accelerator='cpu', or 'auto' to take a GPU only when there is one.")
    if key == "mps" and not torch.backends.mps.is_available():
        raise RuntimeError(f"accelerator='mps' was asked for, but torch {torch.__version__} finds no usable MPS "
                           "device (it needs Apple silicon and macOS 12.3+). Use accelerator='cpu' or 'auto'.")
    return "cuda" if key == "gpu" else key


def _cuda_report() -> str:
    """What torch sees of CUDA, in words."""
    if torch.version.cuda is None:
        return f"this torch build ({torch.__version__}) has no CUDA support"
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    hidden = f" with CUDA_VISIBLE_DEVICES={visible!r}" if visible is not None else ""
    return f"torch {torch.__version__} (built for CUDA {torch.version.cuda}) finds no usable GPU{hidden}"


def device_count(accelerator: str) -> int:
    """How many devices of a resolved accelerator this machine has (on CPU: cores)."""
    if accelerator == "cuda":
        return torch.cuda.device_count()
    if accelerator == "mps":
        return 1
    if accelerator == "cpu":
        return os.cpu_count() or 1
    raise ValueError(f"device_count needs a resolved accelerator ({', '.join(RESOLVED)}); got {accelerator!r}")


def is_interactive() -> bool:
    """True in a notebook, IPython or a REPL: there is no script file that could be re-run in new processes."""
    if hasattr(sys, "ps1") or sys.flags.interactive:
        return True
    main = sys.modules.get("__main__")
    if main is None:
        return False
    main_file = getattr(main, "__file__", None)
    return main_file is None or main_file.startswith("<")   # `python -` (code on stdin) names it '<stdin>'


#: run in a fresh interpreter, so that probing creates no CUDA context in the caller (which forked ranks need)
PROBE = """
import json, torch
usable = {}
for index in range(torch.cuda.device_count()):
    try:
        (torch.ones(1, device=torch.device("cuda", index)) + 1).item()
        usable[index] = None
    except RuntimeError as error:
        usable[index] = str(error).splitlines()[0]
print(json.dumps(usable))
"""


#: the probe's answer, kept for the rest of the script and for the ranks it starts (they inherit the environment)
PROBE_VARIABLE = "EASYFIT_CUDA_PROBE"


def probe_cuda_devices() -> dict[int, str | None]:
    """{visible CUDA device index: None if it took an allocation and a kernel, else why not}; probed once per
    script, so that every rank of a run sees the same answer."""
    answer = os.environ.get(PROBE_VARIABLE)
    if answer is None:
        done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=300)
        if done.returncode:
            raise RuntimeError(f"probing the CUDA devices failed: {done.stderr.strip().splitlines()[-1:]}")
        answer = os.environ[PROBE_VARIABLE] = done.stdout.strip().splitlines()[-1]
    return {int(index): reason for index, reason in json.loads(answer).items()}


def find_usable_cuda_devices(num_devices: int = -1) -> list[int]:
    """The indices of `num_devices` CUDA devices (-1: all) that take an allocation and run a kernel, among those
    CUDA_VISIBLE_DEVICES shows. In the default compute mode a GPU busy with another process still takes work (it is
    shared, not reserved); in exclusive-process mode, or when it is out of memory or broken, it does not."""
    if num_devices == 0 or num_devices < -1:
        raise ValueError(f"num_devices must be a positive count or -1 for all usable devices, got {num_devices}")
    found = probe_cuda_devices()
    usable = [index for index, reason in found.items() if reason is None]
    if num_devices == -1 and usable:
        return usable
    if num_devices != -1 and len(usable) >= num_devices:
        return usable[:num_devices]
    refused = "; ".join(f"device {index}: {reason}" for index, reason in found.items() if reason is not None)
    wanted = "at least one" if num_devices == -1 else str(num_devices)
    raise RuntimeError(f"auto-selecting GPUs: {wanted} usable CUDA device(s) wanted, {len(usable)} of the "
                       f"{len(found)} visible take work" + (f" ({refused})" if refused else "") + ". Free a GPU, "
                       "ask for fewer devices, or check CUDA_VISIBLE_DEVICES and the GPUs' compute mode (nvidia-smi).")


def parse_devices(devices, accelerator: str, interactive: bool | None = None,
                  auto_select: bool = False) -> tuple[str, list[torch.device]]:
    """`devices=` (see the module's table) -> (accelerator, the devices of this node, one per process).

    `accelerator` must already be resolved ('cpu', 'cuda', 'mps' or 'tpu'). It comes back as 'cpu' when devices asks
    for no accelerator device (0, "0", [], None; not on TPUs). `interactive` defaults to `is_interactive()`.
    `auto_select` (or devices="auto_select") takes CUDA devices that take work (`find_usable_cuda_devices`) instead of
    the first ones.
    """
    if accelerator not in RESOLVED:
        raise ValueError(f"parse_devices needs a resolved accelerator ({', '.join(RESOLVED)}); got {accelerator!r}. "
                         "Pass it through resolve_accelerator first.")
    wanted = _read(devices)
    if wanted == "auto_select" or auto_select:
        return "cuda", _auto_selected(devices, -1 if wanted in ("auto_select", "auto") else wanted, accelerator)
    if wanted == 0 and accelerator != "tpu":
        return "cpu", [torch.device("cpu")]
    if wanted == "auto":
        if interactive is None:
            interactive = is_interactive()
        wanted = 1 if accelerator == "cpu" or interactive else -1
    if accelerator == "cpu":
        return "cpu", _cpu_processes(devices, wanted)
    if accelerator == "tpu":
        return "tpu", _xla_devices(devices, wanted)
    return accelerator, [torch.device(accelerator, index) for index in _device_ids(devices, wanted, accelerator)]


def _read(devices) -> int | list[int] | str:
    """The user's value as a count (-1: all; 0: CPU), a list of ids, or 'auto'. Raises on anything else."""
    if devices is None:
        return 0
    if isinstance(devices, bool):
        raise ValueError(f"devices={devices!r}: a bool is not a device choice; pass {FORMS}.")
    if isinstance(devices, numbers.Integral):
        return _count(int(devices), devices)
    if isinstance(devices, str):
        return _read_text(devices)
    if isinstance(devices, (list, tuple)):
        if not all(isinstance(d, numbers.Integral) and not isinstance(d, bool) for d in devices):
            raise ValueError(f"devices={devices!r}: a list must hold integer device ids, e.g. [0, 1].")
        return [int(d) for d in devices] or 0
    raise ValueError(f"devices={devices!r} ({type(devices).__name__}) is not understood; pass {FORMS}.")


def _auto_selected(devices, wanted: int | list[int], accelerator: str) -> list[torch.device]:
    if accelerator != "cuda":
        raise ValueError(f"auto-selecting GPUs (devices={devices!r} / auto_select_gpus=True) picks CUDA devices, but "
                         f"this call runs on {accelerator!r}; use accelerator='gpu' on a machine with CUDA GPUs, or "
                         "drop the auto-selection")
    if isinstance(wanted, list) or wanted == 0:
        raise ValueError(f"auto_select_gpus=True picks the devices itself, but devices={devices!r} names "
                         "them; pass a count (devices=2) or -1 for every usable GPU")
    return [torch.device("cuda", index) for index in find_usable_cuda_devices(wanted)]


def _read_text(devices: str) -> int | list[int] | str:
    """'auto', 'auto_select', '3', '-1', '1, 3' -> what they mean."""
    text = devices.strip()
    if text.lower() in ("auto", "auto_select"):
        return text.lower()
    pieces = [piece.strip() for piece in text.split(",")]
    if not all(re.fullmatch(r"-?[0-9]+", piece) for piece in pieces):
        raise ValueError(f"devices={devices!r} is not understood.{closest_name(text.lower(), ['auto', 'auto_select'])} "
                         f"Pass {FORMS}.")
    if len(pieces) == 1:
        return _count(int(text), devices)
    return [int(piece) for piece in pieces]


def _count(count: int, devices) -> int:
    if count < -1:
        raise ValueError(f"devices={devices!r}: a count must be >= 1, or -1 for all devices, or 0 for CPU.")
    return count


def _cpu_processes(devices, wanted: int | list[int]) -> list[torch.device]:
    """On CPU devices=N means N processes (not capped by the number of cores); -1 means one per core."""
    if isinstance(wanted, list):
        raise ValueError(f"devices={devices!r} lists device ids, but on CPU devices=N is a number of processes: "
                         f"pass devices={len(wanted)} for {len(wanted)} processes, or accelerator='gpu' to use "
                         "those GPUs.")
    count = device_count("cpu") if wanted == -1 else wanted
    return [torch.device("cpu")] * count


def _xla_devices(devices, wanted: int | list[int] | str) -> list[torch.device]:
    """On XLA devices=1 is one device in this process; N and -1 ("auto" outside a notebook) are every device of
    this host, one process each, as torch_xla starts them: [xla:0 .. xla:N-1], or [xla] (no index) for -1, as
    only torch_xla knows how many there are."""
    if isinstance(wanted, list) or wanted == 0:
        raise ValueError(f"devices={devices!r} on TPUs: torch_xla chooses the devices itself, so pass 1, the number "
                         "of this host's devices (e.g. 8), -1 or 'auto' (or accelerator='cpu' to train on the CPU).")
    if wanted == -1:
        return [torch.device("xla")]
    return [torch.device("xla", index) for index in range(wanted)]


def _device_ids(devices, wanted: int | list[int], accelerator: str) -> list[int]:
    """The ids of an accelerator's devices that `wanted` names, checked against what this machine has."""
    available = device_count(accelerator)
    label = LABELS[accelerator]
    plural = "device" if available == 1 else "devices"
    ids = ", ".join(str(index) for index in range(available))
    has = f"this machine has {available} {label} {plural}" + (f" ({ids})" if available else "")
    if wanted == -1:
        wanted = available
    if isinstance(wanted, int):
        if wanted > available or wanted == 0:
            fix = f"; pass devices={available} or -1 for all of them" if available else "; use accelerator='cpu'"
            raise ValueError(f"devices={devices!r}: {has}{fix}.")
        return list(range(wanted))
    negative = [index for index in wanted if index < 0]
    if negative:
        raise ValueError(f"devices={devices!r}: device ids cannot be negative ({negative[0]}); -1 alone means all "
                         f"devices, and {has}.")
    repeated = sorted({index for index in wanted if wanted.count(index) > 1})
    if repeated:
        raise ValueError(f"devices={devices!r}: device {repeated[0]} is listed more than once; list each device "
                         f"once ({has}).")
    missing = [index for index in wanted if index >= available]
    if missing:
        raise ValueError(f"devices={devices!r}: {has}, so there is no device {missing[0]}.")
    return wanted
