"""One 2-process ddp launch of tests/callbacks/scripts/around.py, shared by the tests of the callbacks around the
fit (starting processes is what costs time)."""
from __future__ import annotations

import pytest
from around_helpers import available_checks, run_around


@pytest.fixture(scope="session")
def ddp_around(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("around-ddp")
    return {"out": out, **run_around(out, "ddp", available_checks())}
