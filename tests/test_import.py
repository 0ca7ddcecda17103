"""`import easyfit` stays light: no optional backend, no plotting, and little time on top of `import torch`."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

OPTIONAL = ("deepspeed", "fairscale", "horovod", "bagua", "torch_xla", "matplotlib", "sklearn", "pandas", "scipy",
            "tensorboard")
TIMED_IMPORT = f"""
import json, sys, time
start = time.perf_counter()
import torch
middle = time.perf_counter()
import easyfit
end = time.perf_counter()
print(json.dumps({{"torch": middle - start, "easyfit": end - middle,
                  "optional": [name for name in {OPTIONAL!r} if name in sys.modules]}}))
"""


@pytest.fixture(scope="module")
def fresh_imports() -> list[dict]:
    """Three fresh interpreters, each timing `import torch` and then `import easyfit`."""
    return [json.loads(subprocess.run([sys.executable, "-c", TIMED_IMPORT], capture_output=True, text=True,
                                      check=True, timeout=120).stdout) for _ in range(3)]


@pytest.mark.timeout(400)
def test_import_easyfit_loads_no_optional_package(fresh_imports):
    assert fresh_imports[0]["optional"] == []


@pytest.mark.timeout(400)
def test_import_adds_at_most_150_ms_over_torch(fresh_imports):
    """The best of three runs discounts a busy machine."""
    overhead = min(run["easyfit"] for run in fresh_imports)
    assert overhead <= 0.15, f"import easyfit took {overhead:.3f} s after import torch: {fresh_imports}"
