"""Continuing a run on one process, in the combinations that broke it: a checkpoint after an epoch's last batch, a
save_freq counted across epochs with accumulation windows that start again each epoch, SWA's BatchNorm pass drawing
Dropout masks after the fit, a save after the fit with every stateful callback, CSVLogger's rows after a resume, a
second fit, and a drawn differential over the space
(tests/distributed/scripts/resume_space.py; its multi-process runs are in tests/distributed/test_resume_space.py)."""
from __future__ import annotations

import sys
import warnings
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "distributed" / "scripts"))
import resume_space


def continued(checks: str, out: Path, draws: int = 0) -> dict:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "resuming: no callback of this fit takes", RuntimeWarning)
        results = resume_space.run(dict.fromkeys(checks.split(","), ["single"]), 1, str(out), draws=draws, seed=53)
    assert results
    assert resume_space.differences(results) == []
    return results


def test_a_checkpoint_after_an_epochs_last_batch_resumes_exactly(tmp_path):
    continued("last_batch", tmp_path)


def test_save_freq_a_multiple_of_the_accumulation_never_writes_inside_a_window(tmp_path):
    continued("windows", tmp_path)


def test_swa_s_batchnorm_pass_leaves_the_random_state_the_fit_left(tmp_path):
    continued("swa", tmp_path)


def test_a_save_after_the_fit_holds_every_stateful_callback_and_resumes_as_one_fit(tmp_path):
    assert len(continued("callbacks", tmp_path)["callbacks single states"][0]) > 100   # EMA's averages among them


def test_csv_logger_s_rows_after_a_resume_are_the_uninterrupted_runs(tmp_path):
    rows = continued("csv", tmp_path)["csv single CSVLogger"][1]
    assert [row["epoch"] for row in rows] == [0, 1, 2, 3, 4]


def test_a_second_fit_continues_the_first(tmp_path):
    continued("second_fit", tmp_path)


@pytest.mark.timeout(300)
def test_a_drawn_resume_differential_on_one_process(tmp_path):
    assert len(continued("drawn", tmp_path, draws=8)) == 8
