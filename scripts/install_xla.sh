#!/usr/bin/env bash
# Build, once per machine, the virtual environment the XLA tests run in: torch_xla 2.9.0 with the torch it pins
# (2.9.0), beside (never inside) the main environment, whose torch stays as it is. That torch is easyfit's floor (the
# oldest release it supports: setup.py's torch>=), so the suite's core runs there too, with what it needs.
#
# torch_xla 2.9.0 requires exactly torch 2.9.0, and PyPI's torch 2.9.0 for Linux x86-64 is the CUDA build, which
# links against nvidia-* libraries even where no GPU is used (about 3 GB of them are installed: those it loads). The
# environment is built in $EASYFIT_XLA_VENV (default ~/.cache/easyfit/xla-venv-<version>-py<XY>), marked ready only
# once complete, and reused from then on (a second run takes a second). The tests run from the repository
# (python -m pytest puts it on the path), so easyfit itself is not installed there.
#
# Usage: scripts/install_xla.sh                  build if needed
#        scripts/install_xla.sh --print-python   the environment's interpreter (for: "$(...)" -m pytest tests/xla)
# Environment: EASYFIT_XLA_VENV (where the environment goes), PYTHON (the interpreter it is made from).
set -euo pipefail
cd "$(dirname "$0")/.."

TORCH_XLA_VERSION=2.9.0
TORCH_VERSION=2.9.0
PYTHON=${PYTHON:-python}

name=install_xla.sh what="torch_xla $TORCH_XLA_VERSION" size="about 3 GB"
source scripts/side_venv.sh
mapfile -t core < <(core_test_requirements)
key=$( (cat scripts/install_xla.sh scripts/side_venv.sh; printf '%s\n' "${core[@]}") | sha256sum | cut -c1-12)
venv=${EASYFIT_XLA_VENV:-$HOME/.cache/easyfit/xla-venv-$TORCH_XLA_VERSION-$py_version}
ready="$venv/.easyfit-ready-torch_xla-$TORCH_XLA_VERSION-$key"
start_side_venv "$@"
# The packages that require torch come without their requirements, so that pip resolves no other torch and none
# of the CUDA parts libtorch never loads on a CPU (triton, cusolver, nvrtc, nvtx: 1.2 GB); everything else they
# require is installed next, by name. Bytecode is compiled on import, for the modules the tests use only.
"$py" -m pip install --quiet --no-compile --no-deps "torch==$TORCH_VERSION" "torch_xla==$TORCH_XLA_VERSION" \
    "torchmetrics>=1.0"
mapfile -t requirements < <("$py" - <<'PY'
import importlib.metadata
import re

UNUSED = ("torch", "triton", "nvidia-cusolver", "nvidia-cuda-nvrtc", "nvidia-nvtx")
for package in ("torch", "torch_xla", "torchmetrics"):
    for requirement in importlib.metadata.requires(package) or []:
        name = re.split(r"[\s;<>=!~\[(]", requirement, maxsplit=1)[0].lower().replace("_", "-")
        if "extra ==" not in requirement and not name.startswith(UNUSED):
            print(requirement)
PY
)
"$py" -m pip install --quiet --no-compile --no-warn-conflicts "${requirements[@]}" "${core[@]}"
# a training step on XLA:CPU proves the environment before it is marked ready
PJRT_DEVICE=CPU "$py" -c '
import torch, torch_xla
net = torch.nn.Linear(2, 1).to(torch_xla.device())
net(torch.ones(1, 2, device=torch_xla.device())).sum().backward()
torch_xla.sync()'
finish_side_venv
