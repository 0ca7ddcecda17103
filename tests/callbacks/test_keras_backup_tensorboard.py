"""BackupAndRestore continues a crashed fit exactly; TensorBoard writes what TensorBoard reads and changes nothing."""
from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch
from sklearn.datasets import load_digits
from torch import nn

import easyfit
from easyfit.callbacks import BackupAndRestore, Callback, EarlyStopping, TensorBoard


@pytest.fixture(scope="module")
def digits() -> tuple[np.ndarray, np.ndarray]:
    x, y = load_digits(return_X_y=True)
    return (x / 16.0).astype(np.float32), y.astype(np.int64)


def dropout_model(seed: int = 0) -> easyfit.Model:
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 10))
    return easyfit.Model(net, "cross_entropy", "adam", metrics=["accuracy"], lr=0.01)


class CrashOnce(Callback):
    """Raises in the middle of epoch `epoch` (from 0), the first time only."""

    def __init__(self, epoch: int):
        self.epoch, self.armed, self.current = epoch, True, 0

    def on_epoch_begin(self, epoch, logs=None):
        self.current = epoch

    def on_train_batch_end(self, batch, logs=None):
        if self.armed and self.current == self.epoch and batch == 5:
            self.armed = False
            raise RuntimeError("simulated crash")


def test_a_crashed_fit_started_again_with_the_same_call_equals_an_uninterrupted_one(digits, tmp_path):
    x, y = digits
    kwargs = {"epochs": 6, "batch_size": 64, "validation_split": 0.2, "verbose": 0}
    uninterrupted = dropout_model()
    expected = uninterrupted.fit(x, y, callbacks=[EarlyStopping(patience=10)], **kwargs)

    crash = CrashOnce(epoch=2)
    first = dropout_model()
    with pytest.raises(RuntimeError, match="simulated crash"):
        first.fit(x, y, callbacks=[EarlyStopping(patience=10), BackupAndRestore(tmp_path), crash], **kwargs)
    assert (tmp_path / "backup.pt").is_file()

    restarted = dropout_model()   # a new process: fresh objects, the same call
    history = restarted.fit(x, y, callbacks=[EarlyStopping(patience=10), BackupAndRestore(tmp_path), crash],
                            **kwargs)
    for key, value in uninterrupted.net.state_dict().items():
        assert torch.equal(restarted.net.state_dict()[key], value), key
    assert history.history == expected.history and history.epoch == expected.epoch
    assert not (tmp_path / "backup.pt").exists()   # a fit that ends well deletes its backup


#: the TensorBoard callback writes through the tensorboard package (the extra easyfit[tensorboard])
needs_tensorboard = pytest.mark.skipif(importlib.util.find_spec("tensorboard") is None,
                                       reason="pip install easyfit[tensorboard]")


def read_events(folder):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    accumulator = EventAccumulator(str(folder), size_guidance={"scalars": 0, "histograms": 0})
    accumulator.Reload()
    return accumulator


@needs_tensorboard
def test_tensorboard_writes_epoch_and_batch_scalars_the_graph_and_histograms(digits, tmp_path):
    x, y = digits
    model = dropout_model()
    history = model.fit(x, y, epochs=2, batch_size=128, validation_split=0.2, verbose=0,
                        callbacks=[TensorBoard(tmp_path, histogram_freq=1, update_freq=5)])
    train, validation = read_events(tmp_path / "train"), read_events(tmp_path / "validation")
    assert [event.value for event in train.Scalars("epoch_loss")] == pytest.approx(history.history["loss"])
    assert [event.value for event in validation.Scalars("epoch_accuracy")] == pytest.approx(
        history.history["val_accuracy"])
    steps = history.params["steps_per_epoch"] * 2
    assert [event.step for event in train.Scalars("batch_loss")] == list(range(5, steps + 1, 5))
    assert {"0.weight", "3.bias"} <= set(train.Tags()["histograms"])
    assert train.Tags()["graph"]


@needs_tensorboard
def test_tensorboard_leaves_training_unchanged(digits, tmp_path):
    x, y = digits
    plain = dropout_model()   # each built right before its fit: both start from the same random state
    plain.fit(x, y, epochs=2, verbose=0)
    logged = dropout_model()
    logged.fit(x, y, epochs=2, verbose=0, callbacks=[TensorBoard(tmp_path, histogram_freq=1, update_freq="batch")])
    for key, value in plain.net.state_dict().items():
        assert torch.equal(logged.net.state_dict()[key], value), key


@needs_tensorboard
def test_tensorboard_rejects_a_bad_update_freq(tmp_path):
    with pytest.raises(ValueError, match="update_freq must be 'epoch', 'batch' or a positive number"):
        TensorBoard(tmp_path, update_freq=0)
