"""The learning rate is logged as `learning_rate` (Keras 3's key); `lr` reads it for one release, with a warning."""
from __future__ import annotations

import csv
import warnings

import numpy as np
import pytest
import torch
from torch import nn

import easyfit
from easyfit.callbacks import Callback, CSVLogger, LearningRateScheduler, ModelCheckpoint, ReduceLROnPlateau
from easyfit.callbacks.history import History
from easyfit.callbacks.progress import format_logs


@pytest.fixture
def regression():
    generator = np.random.default_rng(0)
    x = generator.normal(size=(32, 3)).astype("float32")
    return x, x @ np.array([[1.0], [-2.0], [0.5]], dtype="float32")


class EpochLogs(Callback):
    def __init__(self):
        self.read: list[float] = []

    def on_epoch_end(self, epoch, logs=None):
        self.read.append(logs["lr"])   # a callback written for easyfit's old key


def test_the_lr_schedule_is_logged_as_learning_rate_and_lr_reads_it_with_a_warning(regression, tmp_path):
    old_key = EpochLogs()
    model = easyfit.Model(nn.Linear(3, 1), "mse", "sgd", lr=0.1)
    with pytest.warns(DeprecationWarning, match="'lr' is now 'learning_rate'"):
        history = model.fit(*regression, epochs=3, verbose=0, callbacks=[
            LearningRateScheduler(lambda epoch: 0.1 * 0.5 ** epoch), old_key, CSVLogger(tmp_path / "log.csv")])
    assert list(history.history) == ["loss", "learning_rate"]   # each value once, under its new key
    assert history.history["learning_rate"] == [0.1, 0.05, 0.025] == old_key.read
    with pytest.warns(DeprecationWarning, match="read 'learning_rate' instead"):
        assert history.history["lr"] == [0.1, 0.05, 0.025]
    with pytest.warns(DeprecationWarning):
        assert "lr" in history.history and history.history.get("lr") == [0.1, 0.05, 0.025]
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # the new key and other keys read without a warning
        assert history.history.get("accuracy") is None and "accuracy" not in history.history
        with pytest.raises(KeyError):
            history.history["accuracy"]
    with open(tmp_path / "log.csv", newline="") as file:
        assert next(csv.reader(file)) == ["epoch", "loss", "learning_rate"]


def test_reduce_lr_on_plateau_logs_the_learning_rate_each_epoch_trained_with(regression):
    model = easyfit.Model(nn.Linear(3, 1), "mse", "sgd", lr=0.1)
    history = model.fit(*regression, epochs=4, verbose=0, batch_size=32, callbacks=[
        ReduceLROnPlateau("loss", factor=0.5, patience=1, min_delta=100.0)])   # no epoch improves by 100
    assert history.history["learning_rate"] == pytest.approx([0.1, 0.1, 0.05, 0.025])   # the first epoch improves


def test_a_history_saved_with_lr_loads_as_learning_rate(regression, tmp_path):
    history = History()
    history.load_state_dict({"history": {"loss": [1.0], "lr": [0.1]}, "epoch": [0]})
    assert list(history.history) == ["loss", "learning_rate"]
    model = easyfit.Model(nn.Linear(3, 1), "mse", "sgd", lr=0.1)
    model.fit(*regression, epochs=2, verbose=0, callbacks=[LearningRateScheduler(lambda epoch, lr: lr)])
    model.save(tmp_path / "model.pt")   # the state is plain data: it loads with weights_only=True
    loaded = easyfit.Model.load(tmp_path / "model.pt", nn.Linear(3, 1))
    assert loaded.history.history["learning_rate"] == [0.1, 0.1]


def test_small_learning_rates_show_their_digits():
    assert format_logs({"loss": 0.5, "learning_rate": 1e-5}) == "loss: 0.5000 - learning_rate: 1.0000e-05"


def test_a_checkpoint_file_name_with_lr_reads_the_learning_rate_with_a_warning(regression, tmp_path):
    model = easyfit.Model(nn.Linear(3, 1), "mse", "sgd", lr=0.1)
    with pytest.warns(DeprecationWarning, match="'lr' is now 'learning_rate'"):
        model.fit(*regression, epochs=2, verbose=0, callbacks=[LearningRateScheduler(lambda epoch: 0.1 * 0.5 ** epoch),
                                                                ModelCheckpoint(tmp_path / "m-{epoch}-{lr:.3f}.pt")])
    assert sorted(path.name for path in tmp_path.iterdir()) == ["m-1-0.100.pt", "m-2-0.050.pt"]


def test_a_saved_history_loads_with_weights_only(regression, tmp_path):
    model = easyfit.Model(nn.Linear(3, 1), "mse", "sgd", lr=0.1)
    history = model.fit(*regression, epochs=2, verbose=0, callbacks=[LearningRateScheduler(lambda epoch: 0.1)])
    torch.save({"history": history.history}, tmp_path / "history.pt")
    loaded = torch.load(tmp_path / "history.pt", weights_only=True)["history"]
    assert loaded == history.history and list(loaded) == ["loss", "learning_rate"]
    with pytest.warns(DeprecationWarning, match="'lr' is now 'learning_rate'"):
        assert loaded["lr"] == [0.1, 0.1]
