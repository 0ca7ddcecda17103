"""scripts/install_horovod.sh and its compiler wrapper scripts/cxx17, run as CI runs them."""
from __future__ import annotations

import os
import subprocess
import sys
import zipfile
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


def fake_wheel(path: Path) -> Path:
    """A wheel whose METADATA declares requirements as horovod 0.28.1's does: plain, with a version, for old
    Pythons only, and behind extras."""
    wheel = path / "horovod-0.28.1-cp311-cp311-linux_x86_64.whl"
    metadata = "\n".join(["Metadata-Version: 2.1", "Name: horovod", "Version: 0.28.1", "Requires-Dist: cloudpickle",
                          "Requires-Dist: psutil", 'Requires-Dist: dataclasses; python_version < "3.7"',
                          "Requires-Dist: cffi>=1.4.0", 'Requires-Dist: torch; extra == "pytorch"',
                          'Requires-Dist: pyspark>=3.0.0; python_version >= "3.8" and extra == "spark"', ""])
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr("horovod-0.28.1.dist-info/METADATA", metadata)
    return wheel


def test_the_requirements_installed_are_those_the_wheel_declares(tmp_path):
    output = subprocess.run([str(SCRIPTS / "install_horovod.sh"), "--print-requirements", str(fake_wheel(tmp_path))],
                            check=True, text=True, capture_output=True).stdout
    assert output.split() == ["cloudpickle", "psutil", "cffi>=1.4.0"]


def test_an_install_from_the_cache_installs_every_requirement_of_the_wheel(tmp_path):
    """The whole script, with an interpreter that records pip's calls instead of installing (and has no horovod)."""
    log, shim = tmp_path / "pip.log", tmp_path / "python"
    shim.write_text(f'#!/usr/bin/env bash\ncase "$*" in\n  *"-m pip"*) echo "$*" >> "{log}"; exit 0;;\n'
                    '  *"import horovod; print"*) exit 1;;\n  *"hvd.gloo_built"*) exit 0;;\nesac\n'
                    f'exec "{sys.executable}" "$@"\n')
    shim.chmod(0o755)
    environment = {**os.environ, "PYTHON": str(shim), "EASYFIT_WHEEL_CACHE": str(tmp_path / "cache")}
    cache = Path(subprocess.run([str(SCRIPTS / "install_horovod.sh"), "--print-cache-dir"], env=environment, text=True,
                                capture_output=True, check=True).stdout.strip())
    cache.mkdir(parents=True)
    wheel = fake_wheel(cache)
    finished = subprocess.run([str(SCRIPTS / "install_horovod.sh")], env=environment, text=True, capture_output=True,
                              check=False, timeout=100)
    assert finished.returncode == 0, finished.stderr
    assert log.read_text().splitlines() == [f"-m pip install --no-deps --force-reinstall {wheel}",
                                            "-m pip install cloudpickle psutil cffi>=1.4.0"]


def test_the_installed_horovod_has_every_requirement_it_declares():
    pytest.importorskip("horovod", reason="horovod is not installed (scripts/install_horovod.sh installs it)")
    report = subprocess.run([sys.executable, "-m", "pip", "check"], text=True, capture_output=True,
                            check=False).stdout
    assert not [line for line in report.splitlines() if line.lower().startswith("horovod")], report
