"""scripts/install_horovod.sh and its compiler wrapper scripts/cxx17, run as CI runs them."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def test_compiler_wrapper_raises_old_standards_to_cxx17_and_passes_the_rest(tmp_path):
    echo = tmp_path / "echo-args"
    echo.write_text('#!/usr/bin/env bash\nprintf "%s\\n" "$@"\n')
    echo.chmod(0o755)
    arguments = ["-std=c++14", "-O2", "-std=gnu++11", "-std=c++11", "-std=gnu++14", "-std=c++20", "a b.cc", "-o",
                 "x.o"]
    output = subprocess.run([str(SCRIPTS / "cxx17"), *arguments], env={**os.environ, "EASYFIT_REAL_CXX": str(echo)},
                            capture_output=True, text=True, check=True).stdout.splitlines()
    assert output == ["-std=c++17", "-O2", "-std=gnu++17", "-std=c++17", "-std=gnu++17", "-std=c++20", "a b.cc",
                      "-o", "x.o"]


def test_compiler_wrapper_compiles_cxx17_code_given_cxx14(tmp_path):
    source = tmp_path / "x.cc"
    source.write_text("#include <optional>\nint main() { std::optional<int> v = 1; return *v - 1; }\n")
    plain = subprocess.run(["g++", "-std=c++14", "-c", str(source), "-o", str(tmp_path / "plain.o")],
                           capture_output=True, text=True, check=False)
    assert plain.returncode != 0, "this C++17 source must not compile as C++14, or the test proves nothing"
    subprocess.run([str(SCRIPTS / "cxx17"), "-std=c++14", "-c", str(source), "-o", str(tmp_path / "x.o")],
                   check=True)


def test_wheel_cache_is_keyed_by_horovod_torch_and_python_versions(tmp_path):
    output = subprocess.run([str(SCRIPTS / "install_horovod.sh"), "--print-cache-dir"], check=True, text=True,
                            capture_output=True, env={**os.environ, "EASYFIT_WHEEL_CACHE": str(tmp_path)}).stdout
    torch_version = torch.__version__.split("+")[0]
    python = f"py{sys.version_info[0]}{sys.version_info[1]}"
    assert output.strip() == str(tmp_path / f"horovod-0.28.1-torch{torch_version}-{python}")


@pytest.mark.timeout(120)
def test_installed_horovod_is_kept_and_the_script_returns_quickly():
    pytest.importorskip("horovod.torch", reason="horovod is not installed (scripts/install_horovod.sh installs it)")
    finished = subprocess.run([str(SCRIPTS / "install_horovod.sh")], capture_output=True, text=True, timeout=100,
                              check=False)
    assert finished.returncode == 0, finished.stderr
    assert "already installed" in finished.stdout
