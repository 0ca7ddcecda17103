#!/usr/bin/env bash
# Every GPU check in one command, for a machine with one NVIDIA GPU and a Python that holds a CUDA build of torch:
#
#     bash scripts/gpu_check.sh [STEP ...]      (default: every step)
#
# Steps, each under its own time limit, each printing one line (its exit status, seconds and the last line of its
# log; the whole log is in $OUT/STEP.log, OUT defaulting to /tmp/gpu_check):
#   env         the GPU, torch and the optional backends found
#   tests       pytest -m gpu (one xdist worker per test, so the slow sharded ones spread); GPU_TESTS="PATH ..."
#               limits it to those test files
#   quickstart  examples/quickstart.py, which must pick the GPU by itself
#   memory      benchmarks/memory.py --cuda: peak GPU memory of every strategy against plain PyTorch, with the bars
#   gpu         benchmarks/gpu.py: per-step time against the hand-written CUDA loop (MLP, bf16 ResNet-18)
#   steps       benchmarks/gpu_steps.py --compile True,reduce-overhead: the compiled step against the eager hand loop
#   gpt         benchmarks/gpt_mfu.py: a compiled GPT-2-small step's MFU against a hand-written compiled loop's
# tests, quickstart and memory run side by side (none of them is timed); the timed benchmarks then run one by one.
# Packages the machine lacks (DeepSpeed, FairScale and what they need) are installed from wheels in .whl/ when that
# folder exists: fill it on a machine with pip access (`pip download --no-deps ... -d .whl`, see docs/gpu.md).
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT"
PYTHON=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" > /dev/null; then
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/gpu_check_site \
        .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/gpu_check_site
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
steps=("$@")
[[ ${#steps[@]} -gt 0 ]] || steps=(env tests quickstart memory gpu steps gpt)

wanted() { [[ " ${steps[*]} " == *" $1 "* ]]; }

# run NAME LIMIT COMMAND...: the command under LIMIT seconds, its output in $OUT/NAME.log, one line of results
run() {
    local name=$1 limit=$2 started=$SECONDS
    shift 2
    timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
    local status=$?
    echo "$name: exit $status in $((SECONDS - started)) s | $(grep -v '^\s*$' "$OUT/$name.log" | tail -n 1)"
}

if wanted env; then
    run env 60 "$PYTHON" -c "
import importlib.util, torch
found = [name for name in ('deepspeed', 'fairscale', 'transformers', 'torchvision') if importlib.util.find_spec(name)]
print(f'{torch.cuda.get_device_name()} ({torch.cuda.get_device_properties(0).total_memory / 2**30:.0f} GiB), torch {torch.__version__}, CUDA {torch.version.cuda}; found: {found}')"
fi
pids=()
if wanted tests; then
    # shellcheck disable=SC2086
    run tests 250 "$PYTHON" -m pytest ${GPU_TESTS:-} -m gpu -n 8 --dist load -q -o addopts="-p no:cacheprovider" \
        -rfEs --durations=15 &
    pids+=($!)
fi
if wanted quickstart; then
    run quickstart 150 "$PYTHON" -c "
import runpy, easyfit.model
seen = []
fit = easyfit.model.Model.fit
def spying_fit(self, *args, **kwargs):
    history = fit(self, *args, **kwargs)
    seen.append(str(self.strategy.root_device))
    return history
easyfit.model.Model.fit = spying_fit
try:
    runpy.run_path('examples/quickstart.py', run_name='__main__')
finally:
    print(f'quickstart trained on {seen}')" &
    pids+=($!)
fi
if wanted memory; then
    run memory 250 "$PYTHON" benchmarks/memory.py --cuda &
    pids+=($!)
fi
[[ ${#pids[@]} -gt 0 ]] && wait "${pids[@]}"
wanted gpu && run gpu 75 "$PYTHON" benchmarks/gpu.py --rounds 1 --epochs 1 --sides hand,easyfit
wanted steps && run steps 100 "$PYTHON" benchmarks/gpu_steps.py --workloads mlp --rounds 1 --epochs 2 \
    --compile True,reduce-overhead
wanted gpt && run gpt 150 "$PYTHON" benchmarks/gpt_mfu.py --steps 20
echo "gpu_check: done; logs in $OUT"
