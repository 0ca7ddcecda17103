#!/usr/bin/env bash
# Installs easyfit from this checkout, with what its tests need, into the active Python environment (a new venv):
#     scripts/install_dev.sh && python -m pytest -n auto --dist loadscope
# torch first, with its version pinned (see the README), then easyfit with the dev, deepspeed and fairscale extras
# (repeating the pin keeps pip from replacing that torch while it resolves them).
# pip byte-compiles what it installs on one core: the ~22,000 Python files of these ~180 packages took a minute of a
# 2-core machine's install. Here pip skips that and compileall compiles the same files on every core (twice as fast
# on 2 cores). As under pip, a file that does not compile for this Python (torch ships a few written for a newer one)
# stays without bytecode.
set -euo pipefail
cd "$(dirname "$0")/.."
pip install --no-compile torch==2.13.0
pip install --no-compile -e ".[dev,deepspeed,fairscale]" torch==2.13.0
python - <<'EOF'
import compileall
import sysconfig

for folder in sorted({sysconfig.get_path("purelib"), sysconfig.get_path("platlib")}):
    compileall.compile_dir(folder, quiet=2, workers=0)   # a file that does not compile is skipped, as by pip
EOF
