"""The torch releases easyfit names: the floor is one number wherever it is written and the release CI's floor
environment runs, and every release the tests run compile='s fast path on is one easyfit's use of torch's
internals was tested on (easyfit.utils.torch_internals.TESTED_TORCH)."""
from __future__ import annotations

import re
import subprocess

from code_scan import PACKAGE

from easyfit.utils.torch_internals import TESTED_TORCH

ROOT = PACKAGE.parent


def text(path: str) -> str:
    return (ROOT / path).read_text(encoding="utf-8")


def release(version: str) -> str:
    return ".".join(version.split(".")[:2])


def script_torch(script: str) -> str:
    return re.search(r"^TORCH_VERSION=(\S+)$", text(script), re.MULTILINE).group(1)


def test_the_floor_is_one_number_in_every_place_that_states_it():
    floor = re.search(r'"torch>=(\d+\.\d+)"', text("setup.py")).group(1)
    assert f"torch>={floor}" in text("requirements.txt").splitlines()
    for doc in ("README.md", "docs/getting-started.md"):
        assert f"torch {floor} or newer" in text(doc), doc
    assert release(script_torch("scripts/install_xla.sh")) == floor   # the floor's environment in CI


def test_the_releases_the_tests_run_the_fast_path_on_are_tested_ones():
    newest = subprocess.run(["bash", str(ROOT / "scripts" / "install_dev.sh"), "--print-torch"], check=True,
                            capture_output=True, text=True, timeout=30).stdout.strip()
    for version in (newest, script_torch("scripts/install_vision.sh")):
        assert release(version) in TESTED_TORCH, version
