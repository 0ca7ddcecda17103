"""LR scaling holds for any schedule: on 2 ranks with lr_scaling="linear" (factor 2) each optimizer step takes the
one-process schedule's rate times 2, whatever set it (OneCycleLR, CyclicLR, SequentialLR, ChainedScheduler,
ReduceLROnPlateau, LambdaLR, StepLR, a user's own scheduler, the LearningRateScheduler and ReduceLROnPlateau
callbacks); the optimizer holds the schedule's own rate at every batch start and after the fit; no "optimizer.step()
has been overridden" warning. And a differential drawn over schedules, accumulation, clipping and sample weights:
weights and History against plain PyTorch on the combined batch (tests/distributed/scripts/lr_space.py); and under
ddp a compiled fit and a fit resumed mid-epoch (bit for bit the straight fit).

One launch per strategy runs every fit one after the other. EASYFIT_LR_DRAWS sets the drawn configurations per
strategy (3 here), EASYFIT_LR_SEED the draw.
"""
from __future__ import annotations

import importlib
import os

import pytest
import torch
from runner import launch_once, result, run_script

SPACE = importlib.import_module("lr_space")   # tests/distributed/scripts, which runner puts on sys.path

pytestmark = pytest.mark.timeout(300)

STRATEGIES = ("ddp", "ddp_spawn", "fsdp")
DRAWS = int(os.environ.get("EASYFIT_LR_DRAWS", "3"))
SEED = int(os.environ.get("EASYFIT_LR_SEED", "0"))
UNDRAWN = {"accumulate": 1, "clip": None, "weighted": False}


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """launched(strategy) -> (OUT, (stderr, result.pt)) of the strategy's one launch, shared by the tests."""
    def launch(out, strategy: str) -> tuple:
        seed = SEED + STRATEGIES.index(strategy)
        process = run_script(out, strategy, str(DRAWS), str(seed), script="lr_schedules.py", timeout=270)
        assert process.returncode == 0, process.stderr[-4000:]
        return process.stderr, result(out)
    return launch_once(tmp_path_factory, launch)


def assert_same_fit(record: dict, expected: dict, what) -> None:
    assert not SPACE.differences(record, expected), (what, SPACE.differences(record, expected))


@pytest.mark.parametrize("schedule", SPACE.SCHEDULES)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_each_step_takes_the_one_process_schedule_times_the_factor(strategy, schedule, launched):
    record = launched(strategy)[1][1]["schedules"][schedule]
    assert len(record["steps"]) == 16
    assert_same_fit(record, SPACE.plain({"schedule": schedule, **UNDRAWN}), schedule)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_no_warning_that_the_optimizer_step_was_overridden(strategy, launched):
    """torch's LR scheduler warns when the optimizer it steps lost its `step` wrapper: a spawned rank's unpickled
    optimizer, or one a sharded strategy built; fit gives the wrapper back."""
    stderr = launched(strategy)[1][0]
    assert "overridden after learning rate scheduler" not in stderr


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_drawn_schedules_accumulation_clipping_and_weights_equal_plain_pytorch(strategy, launched):
    drawn = launched(strategy)[1][1]["draws"]
    assert len(drawn) == DRAWS
    for config, record in drawn:
        assert_same_fit(record, SPACE.plain(config), config)


def test_a_compiled_fit_takes_the_scaled_schedule(launched):
    """compile=: the compiled optimizer step reads each group's LR from a tensor (a program input), refreshed from
    the scaled rate before the step."""
    config, record = launched("ddp")[1][1]["compiled"]
    assert_same_fit(record, SPACE.plain(config), config)


def test_a_mid_epoch_resume_is_bit_exact_and_the_checkpoint_holds_the_schedules_rates(launched):
    outcome = launched("ddp")[1][1]["resumed"]
    expected = SPACE.plain({"schedule": "LambdaLR", **UNDRAWN})
    assert outcome["lrs"] == pytest.approx([expected["held"][6]], rel=1e-12)   # before the 7th step: unscaled
    for name, value in outcome["straight"].items():
        assert torch.equal(outcome["resumed"][name], value), name
