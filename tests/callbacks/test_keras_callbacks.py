"""ReduceLROnPlateau, LambdaCallback, the on_batch_* aliases, a one-argument LR schedule, EarlyStopping's baseline,
ModelCheckpoint's weights-only files and initial threshold, and the display when output is not a terminal."""
from __future__ import annotations

import sys
import warnings

import pytest
import torch
from torch import nn

import easyfit
from easyfit.callbacks import (
    Callback,
    EarlyStopping,
    LambdaCallback,
    LearningRateScheduler,
    ModelCheckpoint,
    ReduceLROnPlateau,
)
from easyfit.callbacks.progress import EpochSummary, ProgressBar, progress_callbacks


@pytest.fixture
def data() -> dict:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(40, 4, generator=generator)
    return {"x": x, "y": x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]])}


class Inject(Callback):
    """Puts `values[epoch]` into the epoch logs under `key` (before the callbacks after it read them)."""

    def __init__(self, key: str, values: list[float], only_if_present: bool = False):
        self.key, self.values, self.only_if_present = key, values, only_if_present

    def on_epoch_end(self, epoch, logs=None):
        if not self.only_if_present or self.key in logs:
            logs[self.key] = self.values[epoch]


class LRs(Callback):
    """The first param group's LR each epoch trains with."""

    def __init__(self):
        self.lrs: list[float] = []

    def on_epoch_begin(self, epoch, logs=None):
        self.lrs.append(self.model.optimizer.param_groups[0]["lr"])


def fit(data: dict, epochs: int, callbacks: list, lr: float = 0.1, **kwargs) -> easyfit.Model:
    model = easyfit.Model(nn.Linear(4, 1), "mse", "sgd", lr=lr)
    model.fit(**data, epochs=epochs, batch_size=10, verbose=0, callbacks=callbacks, **kwargs)
    return model


def test_reduce_lr_on_plateau_follows_patience_cooldown_and_min_lr(data):
    values = [1.0] * 5 + [0.5] * 7
    lrs = LRs()
    plateau = ReduceLROnPlateau(monitor="score", factor=0.5, patience=2, cooldown=1, min_lr=0.01, min_delta=0)
    fit(data, len(values), [Inject("score", values), plateau, lrs])
    # hand-traced: reductions after epochs 2, 4, 7 and 9 (the last one clipped at min_lr), none after 11
    assert lrs.lrs == pytest.approx([0.1, 0.1, 0.1, 0.05, 0.05, 0.025, 0.025, 0.025, 0.0125, 0.0125, 0.01, 0.01])


def test_reduce_lr_on_plateau_waits_out_epochs_without_validation(data):
    lrs = LRs()
    plateau = ReduceLROnPlateau(monitor="val_loss", factor=0.5, patience=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # epochs without validation are not "missing" values
        fit(data, 8, [Inject("val_loss", [1.0] * 8, only_if_present=True), plateau, lrs],
            validation_data=(data["x"], data["y"]), validation_freq=2)
    # val_loss after epochs 1, 3, 5, 7: best at 1, waiting at 3 and 5, reduced after epoch 5
    assert lrs.lrs == pytest.approx([0.1] * 6 + [0.05] * 2)


def test_reduce_lr_on_plateau_rejects_a_factor_that_would_not_reduce():
    with pytest.raises(ValueError, match="factor must be between 0 and 1"):
        ReduceLROnPlateau(factor=1.5)


def test_lambda_callback_runs_each_given_function_with_the_hook_arguments(data):
    calls = []
    callback = LambdaCallback(on_train_begin=lambda logs: calls.append("begin"),
                              on_epoch_end=lambda epoch, logs: calls.append(("epoch", epoch, "loss" in logs)),
                              on_batch_end=lambda batch, logs: calls.append(("batch", batch)))
    fit(data, 2, [callback])
    assert calls == ["begin", *[("batch", b) for b in range(4)], ("epoch", 0, True),
                     *[("batch", b) for b in range(4)], ("epoch", 1, True)]
    with pytest.raises(TypeError, match="unknown hook 'on_epoch_ends'"):
        LambdaCallback(on_epoch_ends=print)


def test_on_batch_begin_and_end_are_aliases_of_the_training_batch_hooks(data):
    class Legacy(Callback):
        def __init__(self):
            self.seen = []

        def on_batch_begin(self, batch, logs=None):
            self.seen.append(("begin", batch))

        def on_batch_end(self, batch, logs=None):
            self.seen.append(("end", batch, logs["size"]))

    legacy = Legacy()
    fit(data, 1, [legacy], validation_data=(data["x"], data["y"]))   # validation batches do not call them
    assert legacy.seen == [item for b in range(4) for item in (("begin", b), ("end", b, 10))]


def test_learning_rate_scheduler_takes_a_one_argument_schedule(data):
    lrs = LRs()
    fit(data, 3, [LearningRateScheduler(lambda epoch: 0.1 / (epoch + 1)), lrs])
    assert lrs.lrs == pytest.approx([0.1, 0.05, 0.1 / 3])


@pytest.mark.parametrize("values, baseline, stopped_after", [
    ([0.9, 0.9, 0.9, 0.9, 0.9], None, 4),   # improves at epoch 1, then 3 epochs without: stops after epoch 4
    ([0.9, 0.9, 0.9, 0.9, 0.9], 0.5, 3),    # the first value never beat the baseline, so waiting never restarted
    ([0.9, 0.8, 0.7, 0.6, 0.55], 0.5, 5),   # improving every epoch: never stops, baseline or not
    ([0.4, 0.4, 0.4, 0.4, 0.4], 0.5, 4),    # beat the baseline: as without one
])
def test_early_stopping_baseline_as_keras(values, baseline, stopped_after, data):
    model = fit(data, len(values), [Inject("score", values), EarlyStopping("score", patience=3, baseline=baseline)])
    assert model.completed_epochs == stopped_after


def test_model_checkpoint_weights_only_file_loads_into_a_plain_net(data, tmp_path):
    model = fit(data, 2, [ModelCheckpoint(tmp_path / "w-{epoch}.pt", save_weights_only=True)])
    net = nn.Linear(4, 1)
    net.load_state_dict(torch.load(tmp_path / "w-2.pt"))
    torch.testing.assert_close(net.state_dict(), model.net.state_dict())


def test_model_checkpoint_initial_value_threshold_must_be_beaten_before_the_first_save(data, tmp_path):
    values = [0.9, 0.6, 0.4]
    kwargs = {"monitor": "score", "save_best_only": True, "initial_value_threshold": 0.5}
    fit(data, 3, [Inject("score", values), ModelCheckpoint(tmp_path / "best-{epoch}.pt", **kwargs)])
    assert sorted(path.name for path in tmp_path.iterdir()) == ["best-3.pt"]


def test_verbose_1_prints_one_line_per_epoch_when_output_is_not_a_terminal(data, capsys):
    model = easyfit.Model(nn.Linear(4, 1), "mse", "sgd")
    for verbose in (1, "auto"):
        model.fit(**data, epochs=3, batch_size=10, verbose=verbose)
        captured = capsys.readouterr()
        assert "\r" not in captured.out + captured.err
        assert [line.split(" - ")[0] for line in captured.out.splitlines()[1:]] == ["Epoch 1/3", "Epoch 2/3",
                                                                                    "Epoch 3/3"]


def test_verbose_1_draws_a_bar_on_a_terminal(monkeypatch):
    class Terminal:
        def isatty(self):
            return True
    monkeypatch.setattr(sys, "stdout", Terminal())
    monkeypatch.setattr(sys, "stderr", Terminal())
    assert [type(c) for c in progress_callbacks(1, True)] == [ProgressBar]
    assert [type(c) for c in progress_callbacks("auto", True)] == [ProgressBar]
    assert [type(c) for c in progress_callbacks(2, True)] == [EpochSummary]
