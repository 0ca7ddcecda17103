"""scripts/install_xla.sh, as CI runs it: where the environment goes, and a ready one reused at once."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "install_xla.sh"
#: the marker of a ready environment, keyed by what it was built from
READY = ".easyfit-ready-torch_xla-2.9.0-*"


def test_the_environment_is_named_after_torch_xla_and_python_outside_the_repository():
    output = subprocess.run([str(SCRIPT), "--print-python"], check=True, text=True, capture_output=True,
                            env={k: v for k, v in os.environ.items() if k != "EASYFIT_XLA_VENV"}).stdout.strip()
    python = f"py{sys.version_info[0]}{sys.version_info[1]}"
    assert output == os.path.expanduser(f"~/.cache/easyfit/xla-venv-2.9.0-{python}/bin/python")
    assert not Path(output).resolve().is_relative_to(SCRIPT.parents[1])


@pytest.mark.timeout(120)
def test_a_ready_environment_is_reused_in_seconds():
    if not any(Path(sys.prefix).glob(READY)):
        pytest.skip("not running in an environment scripts/install_xla.sh built")
    finished = subprocess.run([str(SCRIPT)], capture_output=True, text=True, timeout=100, check=False,
                              env={**os.environ, "EASYFIT_XLA_VENV": sys.prefix})
    assert finished.returncode == 0, finished.stderr
    assert "environment ready" in finished.stdout
