# Sourced by the scripts that build an environment beside the main one (install_xla.sh, install_vision.sh): what
# they share. The caller sets PYTHON (the interpreter the venv is made from), name (the script's, for its messages),
# what (the environment, in words), venv (its folder), ready (the marker written once it is complete), and may set
# stale (the path prefix of older environments, removed with it) and size (what the build downloads, in words).

# py<major><minor> of $PYTHON, for the environment's folder name
py_version=$("$PYTHON" -c 'import sys; print(f"py{sys.version_info[0]}{sys.version_info[1]}")')

# core_test_requirements: what the suite's core needs besides torch, one a line: easyfit's requirements and the
# extras its tests use, read from setup.py (with the script, what an environment is built from, so a change to
# either builds a new one), and the test runner
core_test_requirements() {
    "$PYTHON" - <<'PY'
import ast
import pathlib

tree = ast.parse(pathlib.Path("setup.py").read_text())
extras = next(node.value for node in ast.walk(tree) if isinstance(node, ast.Assign)
              and getattr(node.targets[0], "id", None) == "EXTRAS")
extras = ast.literal_eval(extras)
install = next(ast.literal_eval(node.value) for node in ast.walk(tree) if isinstance(node, ast.keyword)
               and node.arg == "install_requires")
for requirement in [*install, *extras["export"], *extras["safetensors"], *extras["examples"], "torchmetrics>=1.0",
                    "pytest>=7", "pytest-timeout>=2", "pytest-xdist>=3"]:
    print(requirement)
PY
}

# start_side_venv "$@": with --print-python, print the environment's interpreter and stop; where the environment is
# ready, say so and stop; else make a new venv and set py (its interpreter) and start (the time the build began)
start_side_venv() {
    if [[ "${1:-}" == "--print-python" ]]; then
        echo "$venv/bin/python"
        exit 0
    fi
    # the marker is written last, after a training step ran there; importing the packages to check again would cost
    # as much as the tests' own import
    if [[ -f "$ready" && -x "$venv/bin/python" ]]; then
        echo "$name: $what environment ready at $venv"
        exit 0
    fi
    echo "$name: building the $what environment at $venv${size:+ (downloads $size once)}"
    start=$SECONDS
    rm -rf "$venv" ${stale:+"$stale"*}
    "$PYTHON" -m venv "$venv"
    py="$venv/bin/python"
}

# finish_side_venv: mark the environment ready (call it once a training step ran there)
finish_side_venv() {
    touch "$ready"
    echo "$name: built in $((SECONDS - start)) s"
}
