"""The examples run as a user runs them: as scripts, in a fresh interpreter."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def run_example(name: str, *args: str, timeout: float = 120, env: dict | None = None) -> str:
    """Run examples/<name> with this interpreter (`env`: variables set for it); fail with its output if it exits
    non-zero."""
    result = subprocess.run([sys.executable, str(EXAMPLES / name), *args], capture_output=True, text=True,
                            timeout=timeout, cwd=EXAMPLES.parent, env=None if env is None else {**os.environ, **env})
    assert result.returncode == 0, f"{name} exited with {result.returncode}:\n{result.stdout}\n{result.stderr}"
    return result.stdout


def printed_accuracy(output: str) -> float:
    match = re.search(r"test accuracy:? ([0-9.]+)", output)
    assert match, f"no test accuracy in the output:\n{output}"
    return float(match.group(1))


@pytest.mark.timeout(180)
def test_quickstart_reaches_target_accuracy():
    output = run_example("quickstart.py")
    assert printed_accuracy(output) >= 0.95
    assert "Epoch 25/25" in output


@pytest.mark.timeout(180)
def test_custom_callback_stops_early_and_samples_losses():
    output = run_example("custom_callback.py")
    trained = int(re.search(r"trained (\d+) of 50 epochs", output).group(1))
    assert 1 <= trained < 50
    assert re.search(r"epoch 1 step 0: batch loss [0-9.]+", output)
    assert printed_accuracy(output) > 0.8


@pytest.mark.timeout(240)
def test_ddp_example_trains_on_two_processes_and_prints_once():
    output = run_example("ddp_cpu.py", "--epochs", "3", timeout=200)
    # each process runs its share of the cores unless OMP_NUM_THREADS chose (docs/distributed.md)
    assert re.search(r"effective batch 32 = 16 × 2 processes; (\d+ CPU threads? per process \(\d+ cores / 2 "
                     r"processes; set OMP_NUM_THREADS to choose\); )?lr 0\.05 → 0\.1 \(linear\)", output), output
    assert output.count("test accuracy") == 1
    assert printed_accuracy(output) > 0.85


def test_ci_runs_the_readme_commands_in_a_new_environment():
    """.ci/run takes the quickstart and test commands from the README itself (so they cannot drift apart) and runs
    them in a virtual environment it makes anew for the run (removed first, then made, always at the same path so that
    torch's compile caches keyed by paths are reused): what a newcomer installs."""
    root = EXAMPLES.parent
    readme = (root / "README.md").read_text(encoding="utf-8")
    setup = readme.split("\n## Set up and run\n")[1].split("\n## ")[0]
    commands = re.findall(r"```bash\n(.+?)\n```", setup)
    assert commands[0].startswith("pip install torch==") and commands[0].endswith("python examples/quickstart.py")
    assert commands[1].startswith("scripts/install_dev.sh && ")
    assert commands[1].endswith("python -m pytest -n auto --dist loadscope")
    printed = subprocess.run(["bash", str(root / ".ci" / "run"), "--print-readme-commands"], cwd=root,
                             capture_output=True, text=True, timeout=30, check=True).stdout.splitlines()
    assert printed == commands
    script = (root / ".ci" / "run").read_text(encoding="utf-8")
    made = script.index('python3 -m venv "$venv"')
    assert script.index('rm -rf "$venv"') < made < script.index('eval "${readme[0]}"')
    assert 'eval "${readme[1]}"' in script


@pytest.mark.parametrize("gone", [949, 951])
def test_ci_keeps_its_soak_sizes_for_a_stage_only_while_the_stage_starts_before_its_mark(gone):
    """A slow machine's CI run drops its extra draws and strategies for the stages that start late, to end within 45
    minutes (.ci/run's `soak_while`)."""
    script = (EXAMPLES.parent / ".ci" / "run").read_text(encoding="utf-8")
    sizes = re.search(r"\nsoak_sizes=\(.*?\)\n", script).group(0)   # the names the function unsets
    function = re.search(r"\nsoak_while\(\) \{.*?\n\}\n", script, re.S).group(0)
    soak = {"EASYFIT_COMPILE_CONFIGS": "200", "EASYFIT_ELASTIC_STRATEGIES": "all", "EASYFIT_RAY_STRATEGIES": "all"}
    shown = subprocess.run(["bash", "-c", f'{sizes}{function}SECONDS={gone}; soak_while 950 "the test command"; '
                            'env | grep ^EASYFIT_ | sort'], env={**os.environ, **soak}, capture_output=True,
                           text=True, timeout=30, check=True).stdout
    kept = [line for line in shown.splitlines() if line.partition("=")[0] in soak]
    if gone < 950:
        assert kept == sorted(f"{name}={value}" for name, value in soak.items()), shown
    else:
        assert kept == [] and "before the test command (its mark: 950 s): the rest at a newcomer's sizes" in shown


def test_custom_strategy_example_matches_plain_pytorch():
    """docs/strategies.md's example: a user's Strategy subclass passed to fit trains on 2 CPU processes exactly as
    plain PyTorch does on the combined batch."""
    output = run_example("custom_strategy.py", timeout=200)
    match = re.search(r"max weight difference from plain PyTorch: ([0-9.e+-]+)", output)
    assert match, output
    assert float(match.group(1)) <= 1e-6


@pytest.mark.timeout(300)
def test_tracked_search_prunes_tracks_and_averages(tmp_path):
    """examples/tracked_search.py: every trial has its MLflow run, the bad trial is pruned after one epoch, and the
    best settings reach a sound test accuracy with the EMA weights."""
    for name in ("mlflow", "optuna", "sklearn"):
        pytest.importorskip(name)
    output = run_example("tracked_search.py", "--out", str(tmp_path), timeout=280)
    assert "trial 2: lr 1e-05, hidden 32: pruned after epoch 1" in output
    match = re.search(r"pruned (\d+) of 6 trials; MLflow holds 6 runs", output)
    assert match and int(match.group(1)) >= 1, output
    assert printed_accuracy(output) > 0.9


@pytest.mark.timeout(300)
def test_finetune_text_learns_the_topics_of_python_s_documentation():
    """examples/finetune_text.py: a tokenizer trained on the spot, a datasets.Dataset, a padding collator and
    loss="model" train a small transformer classifier well above chance (0.25) on held-out paragraphs."""
    for name in ("transformers", "datasets", "tokenizers"):
        try:
            __import__(name)
        except Exception as error:   # a broken install skips as a missing one
            pytest.skip(f"{name} unavailable: {error}")
    # one thread: on cores other tests keep busy, torch's threads wait for each other (4 min here, against 25 s)
    output = run_example("finetune_text.py", timeout=280, env={"OMP_NUM_THREADS": "1"})
    assert "Epoch 8/8" in output
    assert printed_accuracy(output) >= 0.6


def test_the_quickstart_installs_only_what_the_examples_need_and_dev_tests_hugging_face():
    readme = (EXAMPLES.parent / "README.md").read_text(encoding="utf-8")
    assert 'pip install torch==2.13.0 && pip install -e ".[examples]" && python examples/quickstart.py' in readme
    namespace: dict = {}
    exec((EXAMPLES.parent / "setup.py").read_text(encoding="utf-8").split("\nsetup(")[0], namespace)
    extras = {name: {re.split(r"[<>=]", requirement)[0] for requirement in requirements}
              for name, requirements in namespace["EXTRAS"].items()}
    assert extras["examples"] == {"scikit-learn", "matplotlib"}
    assert extras["hf"] == {"transformers", "datasets", "tokenizers"}
    assert extras["examples"] | extras["hf"] | {"pytest", "pytest-xdist", "ruff", "torchmetrics"} <= extras["dev"]
    # torchvision's wheels (and timm's, through it) are built for one torch build; beside another, such as the CPU
    # one, their ops fail to load and take torchmetrics' import (so the tests') down with them
    assert not {"torchvision", "timm"} & set().union(*extras.values())


@pytest.mark.timeout(900)
def test_ray_cluster_example_fits_on_a_ray_cluster_and_asha_stops_a_bad_trial(ray_cluster, tmp_path):
    """examples/ray_cluster.py on the session's Ray cluster (RAY_ADDRESS): launcher="ray" trains on 2 workers, then a
    4-trial Tune search whose ASHA scheduler stops at least one trial early and reports the best lr (a large one); the
    runs' files go in a temporary folder the example removes."""
    pytest.importorskip("ray.tune", reason='the Ray example needs Ray: pip install "easyfit[ray]"')
    output = run_example("ray_cluster.py", "--epochs", "4", timeout=850,
                         env={"OMP_NUM_THREADS": "1", "RAY_ADDRESS": ray_cluster.address, "TMPDIR": str(tmp_path)})
    assert not list(tmp_path.glob("easyfit-ray-*")), "the example left its storage folder behind"
    first, last = map(float, re.search(r"launcher='ray': loss ([0-9.]+) -> ([0-9.]+)", output).groups())
    assert last < first
    assert int(re.search(r"stopped early: (\d+)", output).group(1)) >= 1
    assert re.search(r"best lr (0\.3|0\.1) ", output), output


@pytest.mark.timeout(400)
def test_vision_example_trains_with_validation_plots_and_exports(tmp_path):
    """Runs in the vision environment (scripts/install_vision.sh), where easyfit is not installed."""
    pytest.importorskip("torchvision", reason="the vision environment: scripts/install_vision.sh")
    output = run_example("vision.py", "--out", str(tmp_path), timeout=360,
                         env={"PYTHONPATH": os.pathsep.join([str(EXAMPLES.parent), os.environ.get("PYTHONPATH", "")])})
    assert printed_accuracy(output) >= 0.9
    assert "val_accuracy" in output and (tmp_path / "vision_curves.png").stat().st_size > 0
    assert float(re.search(r"outputs match predict's to ([0-9.e+-]+)", output).group(1)) < 1e-5
