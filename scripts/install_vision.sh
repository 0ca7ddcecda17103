#!/usr/bin/env bash
# Build, once per machine, the virtual environment the vision tests run in: torchvision and timm on the newest torch
# this machine's pip offers (torch 2.14.1, torchvision 0.29.1), beside (never inside) the main environment, whose
# CPU build of torch stays as it is (PyPI's torchvision does not load beside it).
#
# PyPI's torch 2.14.1 for Linux x86-64 is the CUDA build: about 5.5 GB with its nvidia-* libraries, which run on
# the CPU as well. On a machine whose pip has these wheels on its local disk the install reads them there; elsewhere
# pip downloads them (once: pip's cache keeps them). The environment is built in $EASYFIT_VISION_VENV (default
# ~/.cache/easyfit/vision-venv-torch<version>-tv<version>-py<XY>-<hash of this script and setup.py>), marked ready
# only once complete, and reused from then on. Besides torchvision and timm it holds what the core tests need
# (easyfit's requirements, pytest, torchmetrics, scikit-learn, the export extra); the tests run from the repository
# (python -m pytest puts it on the path), so easyfit itself is not installed there.
#
# Usage: scripts/install_vision.sh                  build if needed
#        scripts/install_vision.sh --print-python   the environment's interpreter (for: "$(...)" -m pytest tests/vision)
# Environment: EASYFIT_VISION_VENV (where the environment goes), PYTHON (the interpreter it is made from).
set -euo pipefail
cd "$(dirname "$0")/.."

TORCH_VERSION=2.14.1
TORCHVISION_VERSION=0.29.1
PYTHON=${PYTHON:-python3}

name=install_vision.sh what="torch $TORCH_VERSION / torchvision $TORCHVISION_VERSION"
source scripts/side_venv.sh
mapfile -t requirements < <(core_test_requirements)
key=$( (cat scripts/install_vision.sh scripts/side_venv.sh; printf '%s\n' "${requirements[@]}") | sha256sum | cut -c1-12)
venv=${EASYFIT_VISION_VENV:-$HOME/.cache/easyfit/vision-venv-torch$TORCH_VERSION-tv$TORCHVISION_VERSION-$py_version-$key}
ready="$venv/.easyfit-ready-vision-$key"
stale="$(dirname "$venv")/vision-venv-"   # an environment built from older files is not used again
start_side_venv "$@"
# torch and torchvision are pinned in the same command, so that pip resolves no other torch for them
"$py" -m pip install --quiet --no-compile "torch==$TORCH_VERSION" "torchvision==$TORCHVISION_VERSION" timm \
    "${requirements[@]}"
# a training step of a torchvision and a timm model proves the environment before it is marked ready
"$py" -c '
import timm, torch, torchvision
for net in (torchvision.models.resnet18(weights=None, num_classes=10), timm.create_model("resnet10t", num_classes=10)):
    net(torch.randn(2, 3, 32, 32)).sum().backward()'
finish_side_venv
