#!/usr/bin/env bash
# Installs easyfit from this checkout, with what its tests need, into the active Python environment (a new venv):
#     scripts/install_dev.sh && python -m pytest -n auto --dist loadscope
# The tests run on the newest torch release (what a plain `pip install torch` gives a user), named once below:
# moving to the next release is that line, easyfit.utils.torch_internals.TESTED_TORCH, and a green run
# (CONTRIBUTING.md, "A new torch release"). pip installs uv, which installs torch with its version pinned and easyfit
# with the dev, deepspeed and fairscale extras: uv fetches and unpacks the packages in parallel, where pip takes one at a
# time (torch's CUDA build and its CUDA libraries, about 3 GB to fetch and 6 GB unpacked, with the extras: 142 s under
# pip and 31 s under uv on a 2-core machine, pip's and uv's caches off; the same releases of every package). uv reads
# neither pip's config nor its constraints file (PIP_CONSTRAINT, which on some machines caps torch at an older release):
# where uv cannot install (a registry only pip's config names), pip does, as before.
# Neither byte-compiles here: compileall compiles the ~22,000 Python files of these ~180 packages on every core (pip
# took a minute of a 2-core machine for it, on one core). As under pip, a file that does not compile for this Python
# (torch ships a few written for a newer one) stays without bytecode.
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
if ! { python -m pip install uv &&
       python -m uv pip install --python "$(command -v python)" -e ".[dev,deepspeed,fairscale]" "torch==$TORCH_VERSION"; }
then   # no uv, or a registry only pip's config names (a mirror): pip, torch first (repeating its pin keeps pip from
       # replacing it while it resolves the extras)
    echo "install_dev.sh: uv could not install (above); pip installs instead" >&2
    PIP_CONSTRAINT=/dev/null pip install --no-compile "torch==$TORCH_VERSION"
    PIP_CONSTRAINT=/dev/null pip install --no-compile -e ".[dev,deepspeed,fairscale]" "torch==$TORCH_VERSION"
fi
python - <<'PY'
import compileall
import sysconfig

for folder in sorted({sysconfig.get_path("purelib"), sysconfig.get_path("platlib")}):
    compileall.compile_dir(folder, quiet=2, workers=0)   # a file that does not compile is skipped, as by pip
PY
