#!/usr/bin/env bash
# Install Horovod 0.28.1 (PyTorch + Gloo, CPU) on the installed torch, from a cached wheel when there is one.
#
# Horovod 0.28.1 is published as source only, and its CMake forces -std=c++14, which torch >= 2.1 headers reject.
# This script builds the wheel once with scripts/cxx17, a compiler wrapper that turns -std=c++11/14 (and
# gnu++11/14) into -std=c++17; caches it under $EASYFIT_WHEEL_CACHE (default ~/.cache/easyfit/wheels) in a
# directory named after the horovod, torch and Python versions; and installs from that cache on every later run
# (seconds). An installed horovod that imports against the current torch is left as it is.
#
# Usage: scripts/install_horovod.sh            build if needed, then install (with every requirement the wheel declares)
#        scripts/install_horovod.sh --print-cache-dir
#        scripts/install_horovod.sh --print-requirements WHEEL   the requirements it installs for WHEEL
# Environment: EASYFIT_WHEEL_CACHE (cache root), PYTHON (interpreter, default python),
#              MAKEFLAGS (build parallelism, default -j<cores>).
set -euo pipefail

HOROVOD_VERSION=0.28.1
PYTHON=${PYTHON:-python}
CACHE_ROOT=${EASYFIT_WHEEL_CACHE:-$HOME/.cache/easyfit/wheels}

torch_version=$("$PYTHON" -c 'import torch; print(torch.__version__.split("+")[0])') || {
    echo "install_horovod.sh: torch is not importable with $PYTHON; install torch first." >&2
    exit 1
}
py_version=$("$PYTHON" -c 'import sys; print(f"py{sys.version_info[0]}{sys.version_info[1]}")')
cache_dir="$CACHE_ROOT/horovod-$HOROVOD_VERSION-torch$torch_version-$py_version"

if [[ "${1:-}" == "--print-cache-dir" ]]; then
    echo "$cache_dir"
    exit 0
fi

# The requirements a wheel declares (Requires-Dist in its METADATA) that apply to this Python without extras, one a
# line; torch is left out, so pip never resolves a torch of its own.
wheel_requirements() {
    "$PYTHON" - "$1" <<'PY'
import sys
import zipfile

try:
    from packaging.requirements import Requirement
except ImportError:   # pip carries its own copy
    from pip._vendor.packaging.requirements import Requirement

with zipfile.ZipFile(sys.argv[1]) as wheel:
    metadata = next(name for name in wheel.namelist() if name.endswith(".dist-info/METADATA"))
    lines = wheel.read(metadata).decode("utf-8").splitlines()
for line in lines:
    if not line.startswith("Requires-Dist:"):
        continue
    requirement = Requirement(line.split(":", 1)[1].strip())
    if requirement.marker is not None and not requirement.marker.evaluate({"extra": ""}):
        continue
    if requirement.name.lower() != "torch":
        extras = f"[{','.join(sorted(requirement.extras))}]" if requirement.extras else ""
        print(f"{requirement.name}{extras}{requirement.specifier}")
PY
}

if [[ "${1:-}" == "--print-requirements" ]]; then
    wheel_requirements "${2:?--print-requirements needs the path of a wheel}"
    exit 0
fi

installed=$("$PYTHON" -c 'import horovod; print(horovod.__version__)' 2>/dev/null || true)
if [[ "$installed" == "$HOROVOD_VERSION" ]] && "$PYTHON" -c 'import horovod.torch' 2>/dev/null; then
    echo "install_horovod.sh: horovod $HOROVOD_VERSION already installed and importable"
    exit 0
fi

wheel=$(ls "$cache_dir"/horovod-"$HOROVOD_VERSION"-*.whl 2>/dev/null | head -n 1 || true)
if [[ -z "$wheel" ]]; then
    command -v cmake >/dev/null || "$PYTHON" -m pip install cmake
    work=$(mktemp -d)
    trap 'rm -rf "$work"' EXIT
    echo "install_horovod.sh: building horovod $HOROVOD_VERSION for torch $torch_version ($py_version); takes minutes"
    start=$SECONDS
    HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITHOUT_MPI=1 HOROVOD_WITHOUT_TENSORFLOW=1 \
    HOROVOD_WITHOUT_MXNET=1 HOROVOD_CPU_OPERATIONS=gloo CXX="$(cd "$(dirname "$0")" && pwd)/cxx17" \
    MAKEFLAGS=${MAKEFLAGS:--j$(nproc)} \
        "$PYTHON" -m pip wheel --no-build-isolation --no-deps --no-binary horovod \
        -w "$work/wheel" "horovod==$HOROVOD_VERSION"
    mkdir -p "$cache_dir"
    cp "$work"/wheel/horovod-*.whl "$cache_dir/"
    wheel=$(ls "$cache_dir"/horovod-"$HOROVOD_VERSION"-*.whl | head -n 1)
    echo "install_horovod.sh: built $wheel in $((SECONDS - start)) s"
fi

# --no-deps: the wheel's requirements (cloudpickle, psutil, pyyaml, packaging, cffi, ...: every one it declares, read
# from the wheel itself) are installed by name below, so pip never resolves a torch of its own.
requirements=$(wheel_requirements "$wheel")
"$PYTHON" -m pip install --no-deps --force-reinstall "$wheel"
if [[ -n "$requirements" ]]; then
    mapfile -t requirement_list <<< "$requirements"
    "$PYTHON" -m pip install "${requirement_list[@]}"
fi
"$PYTHON" -c 'import horovod.torch as hvd; assert hvd.gloo_built(), "horovod was built without gloo"'
echo "install_horovod.sh: horovod $HOROVOD_VERSION installed from $wheel"
