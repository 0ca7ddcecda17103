"""Continuing a run on 2 CPU processes: a checkpoint after an epoch's last batch, a save_freq with accumulation
windows, SWA's BatchNorm pass, a model.save after the fit with every stateful callback (a spawned fit's caller holds
rank 0's callback states), CSVLogger's rows, a second fit under every strategy (the sharded ones hand their
optimizer state back and take it up again), and a drawn resume differential over the strategies
(tests/distributed/scripts/resume_space.py). Each continued run must equal one uninterrupted fit: the weights bit for
bit, the History's loss and CSV's values up to rounding. After a fit with BatchNorm every rank holds rank 0's net, and
predict and evaluate on 2 ranks give its numbers.

One launch under the script launcher runs every check of ddp and the sharded strategies; one caller runs ddp_spawn's
(each of its fits spawns its ranks): starting processes is what costs time here."""
from __future__ import annotations

import importlib.util

import pytest
import torch
from runner import launch_once, run_script  # puts tests/distributed/scripts on the path

# isort: split
from resume_space import differences

pytestmark = pytest.mark.timeout(600)

HAS = {name: importlib.util.find_spec(name) is not None for name in ("deepspeed", "fairscale")}
NEEDS = {"ddp_sharded": "fairscale", **{f"deepspeed_stage_{stage}": "deepspeed" for stage in (1, 2, 3)}}
SHARDED = ["fsdp", "zero", "ddp_sharded", "deepspeed_stage_1", "deepspeed_stage_2", "deepspeed_stage_3"]
ISSUE_CHECKS = "last_batch,windows,swa,callbacks,csv"
SPAWN_CHECKS = "last_batch,windows,swa,callbacks,csv"
DRAWS, SEED = 4, 53


def installed(strategies: list[str]) -> list[str]:
    return [name for name in strategies if HAS.get(NEEDS.get(name), True)]


def plan(launcher: str) -> list[str]:
    """The launch's CHECK=STRATEGY arguments: every check under ddp (or ddp_spawn), a second fit under every sharded
    strategy, a checkpoint after an epoch's last batch under FairScale's and DeepSpeed's, and the drawn differential."""
    if launcher == "ddp_spawn":
        return [f"{SPAWN_CHECKS}=ddp_spawn"]
    sharded = installed(SHARDED)
    return [f"{ISSUE_CHECKS}=ddp", f"second_fit={','.join(['ddp', *sharded])}", "batchnorm=ddp,fsdp",
            f"last_batch={','.join(installed(['ddp_sharded', 'deepspeed_stage_2']) or ['zero'])}",
            f"drawn={','.join(['ddp', *installed(['fsdp', 'zero', 'ddp_sharded', 'deepspeed_stage_2'])])}"]


@pytest.fixture(scope="module")
def launch(tmp_path_factory):
    """launch(launcher) -> {name: (straight, continued)}, run once for the module."""
    def run(out, launcher: str) -> dict:
        process = run_script(out, *plan(launcher), "--draws", str(DRAWS if launcher == "ddp" else 0), "--seed",
                             str(SEED), script="resume_space.py", timeout=540)
        assert process.returncode == 0, process.stderr[-6000:]
        return torch.load(out / "result.pt", weights_only=False)
    once = launch_once(tmp_path_factory, run)
    return lambda launcher: once(launcher)[1]


def check(results: dict, prefix: str, count: int | None = None) -> None:
    chosen = {name: pair for name, pair in results.items() if name.startswith(prefix)}
    assert chosen and (count is None or len(chosen) == count), sorted(results)
    assert differences(chosen) == []


@pytest.mark.parametrize("launcher", ["ddp", "ddp_spawn"])
def test_a_checkpoint_after_an_epochs_last_batch_resumes_on_every_rank(launch, launcher):
    check(launch(launcher), f"last_batch {launcher} ")


def test_the_sharded_strategies_resume_a_checkpoint_after_an_epochs_last_batch(launch):
    for strategy in installed(["ddp_sharded", "deepspeed_stage_2"]):
        check(launch("ddp"), f"last_batch {strategy} ", count=2)


@pytest.mark.parametrize("launcher", ["ddp", "ddp_spawn"])
def test_save_freq_with_accumulation_writes_whole_windows_and_the_restart_resumes(launch, launcher):
    check(launch(launcher), f"windows {launcher} ", count=2)


@pytest.mark.parametrize("launcher", ["ddp", "ddp_spawn"])
def test_swa_s_batchnorm_pass_leaves_the_random_state_as_it_found_it(launch, launcher):
    check(launch(launcher), f"swa {launcher} ", count=1)


@pytest.mark.parametrize("launcher", ["ddp", "ddp_spawn"])
def test_a_save_after_the_fit_holds_every_stateful_callback_and_resumes_as_one_fit(launch, launcher):
    """EMA, EarlyStopping, ReduceLROnPlateau and ModelCheckpoint: 2 epochs, model.save, a resume to 4 against 4
    straight; the weights and every number of the callbacks' states after the fit."""
    check(launch(launcher), f"callbacks {launcher} ", count=2)


@pytest.mark.parametrize("launcher", ["ddp", "ddp_spawn"])
def test_csv_logger_s_rows_after_a_resume_are_the_uninterrupted_runs(launch, launcher):
    check(launch(launcher), f"csv {launcher} ", count=1)


@pytest.mark.parametrize("strategy", ["ddp", *SHARDED])
def test_a_second_fit_continues_the_first_with_momentum_and_adam_over_two_param_groups(launch, strategy):
    if not HAS.get(NEEDS.get(strategy), True):
        pytest.skip(f"pip install easyfit[{NEEDS[strategy]}]")
    check(launch("ddp"), f"second_fit {strategy} ", count=2)


def test_a_drawn_resume_differential_over_the_strategies(launch):
    check(launch("ddp"), "drawn ", count=DRAWS)


def test_after_a_fit_with_batchnorm_every_rank_holds_rank_zeros_net_and_serves_it_exactly(launch):
    """BatchNorm's running statistics, which each rank updates from its own batches, are rank 0's in every process
    after the fit: the fit's last validation, a predict and an evaluate on 2 ranks give rank 0's net's numbers as
    plain PyTorch (under ddp and fsdp here, and under the drawn configurations with BatchNorm)."""
    for strategy in ("ddp", "fsdp"):
        check(launch("ddp"), f"batchnorm {strategy} ", count=4)
    check(launch("ddp"), "served ")
