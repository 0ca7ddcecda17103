#!/usr/bin/env bash
# The differential test of compile= against eager (tests/training/test_compile_differential.py) over many more drawn
# configurations than CI runs: each is fitted eagerly and compiled, and must agree within its tolerance.
#
# Usage: scripts/compile_soak.sh [COUNT [SEED [INDUCTOR_EVERY]]]
#   COUNT           configurations drawn (default 2000)
#   SEED            the draw (default 1: CI draws with 0)
#   INDUCTOR_EVERY  one family (of 8 configurations) in this many compiles with inductor, the rest with aot_eager (default 5)
# Prints pytest's summary: one line per failing configuration, named by its settings.
set -euo pipefail
cd "$(dirname "$0")/.."
EASYFIT_COMPILE_CONFIGS=${1:-2000} EASYFIT_COMPILE_SEED=${2:-1} EASYFIT_COMPILE_INDUCTOR_EVERY=${3:-5} \
    python -m pytest -q -p no:randomly -o addopts="" --timeout=1800 tests/training/test_compile_differential.py
