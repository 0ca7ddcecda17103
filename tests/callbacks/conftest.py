"""One 2-process ddp launch of tests/callbacks/scripts/around.py, shared by the tests of the callbacks around the
fit (starting processes is what costs time)."""
from __future__ import annotations

import pytest
from around_helpers import STDERR_FILE, available_checks, read_around, run_around
from filelock import FileLock


@pytest.fixture(scope="session")
def ddp_around(tmp_path_factory) -> dict:
    """Run once per pytest run: its modules spread over the pytest-xdist workers, which share the folder above their
    own temporary folders; the first worker to need the launch runs it there, the others wait for it and read it."""
    shared = tmp_path_factory.getbasetemp()
    if shared.name.startswith("popen-gw"):   # a pytest-xdist worker's folder, in the run's folder
        shared = shared.parent
    out = shared / "around-ddp"
    checks = available_checks()
    with FileLock(str(shared / "around-ddp.lock")):
        if (out / STDERR_FILE).exists():
            return {"out": out, **read_around(out, ["ddp"], checks)["ddp"]}
        out.mkdir(exist_ok=True)
        return {"out": out, **run_around(out, "ddp", checks)}
