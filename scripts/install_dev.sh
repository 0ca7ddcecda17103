#!/usr/bin/env bash
# Installs easyfit from this checkout, with what its tests need, into the active Python environment (a new venv):
#     scripts/install_dev.sh && python -m pytest -n auto --dist loadscope
# The tests run on the newest torch release (what a plain `pip install torch` gives a user), named once below:
# moving to the next release is that line, easyfit.utils.torch_internals.TESTED_TORCH, and a green run
# (CONTRIBUTING.md, "A new torch release"). torch goes first, with its version pinned, then easyfit with the dev,
# deepspeed and fairscale extras (repeating the pin keeps pip from replacing that torch while it resolves them). A pip
# whose constraints file caps torch at an older release (PIP_CONSTRAINT, pip's config) would refuse the pin, so these
# two commands run without it.
# pip byte-compiles what it installs on one core: the ~22,000 Python files of these ~180 packages took a minute of a
# 2-core machine's install. Here pip skips that and compileall compiles the same files on every core (twice as fast
# on 2 cores). As under pip, a file that does not compile for this Python (torch ships a few written for a newer one)
# stays without bytecode.
#
# Usage: scripts/install_dev.sh                  install
#        scripts/install_dev.sh --print-torch    the torch release the tests run on
set -euo pipefail
cd "$(dirname "$0")/.."

TORCH_VERSION=2.15.0

if [[ "${1:-}" == "--print-torch" ]]; then
    echo "$TORCH_VERSION"
    exit 0
fi
PIP_CONSTRAINT=/dev/null pip install --no-compile "torch==$TORCH_VERSION"
PIP_CONSTRAINT=/dev/null pip install --no-compile -e ".[dev,deepspeed,fairscale]" "torch==$TORCH_VERSION"
python - <<'PY'
import compileall
import sysconfig

for folder in sorted({sysconfig.get_path("purelib"), sysconfig.get_path("platlib")}):
    compileall.compile_dir(folder, quiet=2, workers=0)   # a file that does not compile is skipped, as by pip
PY
