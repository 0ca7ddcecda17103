"""Every built-in callback, for real through Model.fit on tiny data, and the hook order a user callback sees."""
from __future__ import annotations

import copy
import csv
import math

import pytest
import torch
from torch import nn
from torch.nn import functional

import easyfit
from easyfit.callbacks import Callback, CSVLogger, EarlyStopping, LearningRateScheduler, ModelCheckpoint, TerminateOnNaN
from easyfit.callbacks.monitor import Monitor

WEIGHTS = torch.tensor([[1.0], [-2.0], [0.5], [3.0]])


def zero_linear() -> nn.Linear:
    net = nn.Linear(4, 1)
    nn.init.zeros_(net.weight)
    nn.init.zeros_(net.bias)
    return net


@pytest.fixture
def overshoot() -> dict:
    """Train towards y = x·w while validating on y = x·w/2: starting from zero weights, the validation loss falls,
    bottoms out in the middle of training, then rises."""
    generator = torch.Generator().manual_seed(3)
    x, x_val = torch.randn(64, 4, generator=generator), torch.randn(32, 4, generator=generator)
    return {"x": x, "y": x @ WEIGHTS, "validation_data": (x_val, x_val @ WEIGHTS / 2)}


def fit(model: easyfit.Model, data: dict, epochs: int, callbacks: list, **kwargs) -> easyfit.History:
    return model.fit(**data, epochs=epochs, batch_size=16, verbose=0, callbacks=callbacks, **kwargs)


def sgd_model(net: nn.Module | None = None, lr: float = 0.02, **kwargs) -> easyfit.Model:
    return easyfit.Model(net or zero_linear(), "mse", "sgd", lr=lr, **kwargs)


class WeightSnapshots(Callback):
    """The net's weights at the end of each epoch."""

    def __init__(self):
        self.weights: list[dict] = []

    def on_epoch_end(self, epoch, logs=None):
        self.weights.append(copy.deepcopy(self.model.net.state_dict()))


class HookRecorder(Callback):
    def __init__(self):
        self.calls: list[tuple] = []
        self.batch_logs: list[dict] = []
        self.epoch_logs: list[dict] = []

    def on_train_begin(self, logs=None):
        self.calls.append(("train_begin",))

    def on_epoch_begin(self, epoch, logs=None):
        self.calls.append(("epoch_begin", epoch))

    def on_train_batch_begin(self, batch, logs=None):
        self.calls.append(("batch_begin", batch))

    def on_train_batch_end(self, batch, logs=None):
        self.calls.append(("batch_end", batch))
        self.batch_logs.append(dict(logs))

    def on_test_begin(self, logs=None):
        self.calls.append(("test_begin",))

    def on_test_batch_end(self, batch, logs=None):
        self.calls.append(("test_batch_end", batch))

    def on_test_end(self, logs=None):
        self.calls.append(("test_end",))

    def on_epoch_end(self, epoch, logs=None):
        self.calls.append(("epoch_end", epoch))
        self.epoch_logs.append(dict(logs))

    def on_train_end(self, logs=None):
        self.calls.append(("train_end",))


# --- a user callback ------------------------------------------------------------------------
def test_user_callback_receives_hooks_in_order(overshoot):
    recorder = HookRecorder()
    model = sgd_model()
    history = model.fit(**overshoot, epochs=2, batch_size=32, validation_batch_size=32, verbose=0,
                        callbacks=[recorder])
    epoch = [("batch_begin", 0), ("batch_end", 0), ("batch_begin", 1), ("batch_end", 1),
             ("test_begin",), ("test_batch_end", 0), ("test_end",)]
    assert recorder.calls == [("train_begin",), ("epoch_begin", 0), *epoch, ("epoch_end", 0),
                              ("epoch_begin", 1), *epoch, ("epoch_end", 1), ("train_end",)]
    assert recorder.model is model and recorder.params["epochs"] == 2 and recorder.params["steps_per_epoch"] == 2
    assert recorder.epoch_logs == [{key: values[i] for key, values in history.history.items()} for i in range(2)]
    assert set(recorder.batch_logs[0]) == {"loss", "batch_loss", "size"} and recorder.batch_logs[0]["size"] == 32
    assert recorder.batch_logs[1]["loss"] == pytest.approx(
        (recorder.batch_logs[0]["batch_loss"] + recorder.batch_logs[1]["batch_loss"]) / 2)


# --- EarlyStopping --------------------------------------------------------------------------
def test_early_stopping_stops_and_restores_the_best_weights(overshoot):
    snapshots = WeightSnapshots()
    stopper = EarlyStopping(patience=2, restore_best_weights=True)
    model = sgd_model()
    history = fit(model, overshoot, 50, [snapshots, stopper])
    val_losses = history.history["val_loss"]
    best = val_losses.index(min(val_losses))
    assert 0 < best < len(val_losses) - 1, "the data should make the validation loss turn"
    assert len(history.epoch) == best + 3 < 50 and stopper.stopped_epoch == best + 2
    assert stopper.best_epoch == best and stopper.best == val_losses[best]
    torch.testing.assert_close(model.net.state_dict(), snapshots.weights[best], rtol=0, atol=0)
    assert not torch.equal(snapshots.weights[-1]["weight"], snapshots.weights[best]["weight"])


def test_early_stopping_min_delta_baseline_and_start_epoch(overshoot):
    assert len(fit(sgd_model(), overshoot, 30, [EarlyStopping(monitor="loss", min_delta=1e9)]).epoch) == 2
    # an unreachable baseline never restarts the waiting, but an improving epoch never stops: the training loss
    # falls every epoch, so all 30 run (test_keras_callbacks traces the baseline rule epoch by epoch)
    assert len(fit(sgd_model(), overshoot, 30, [EarlyStopping(monitor="loss", baseline=-1.0, patience=3)]).epoch) == 30
    late = EarlyStopping(monitor="loss", min_delta=1e9, start_from_epoch=5)
    assert len(fit(sgd_model(), overshoot, 30, [late]).epoch) == 7 and late.best_epoch == 5


def test_early_stopping_warns_about_a_missing_monitor_with_the_available_keys(regression):
    with pytest.warns(RuntimeWarning, match=r"'val_loss' is not in the logs; available: loss"):
        history = sgd_model().fit(*regression, epochs=3, verbose=0, callbacks=[EarlyStopping()])
    assert len(history.epoch) == 3


@pytest.mark.parametrize("name, mode", [("val_loss", "min"), ("val_accuracy", "max"), ("top5_accuracy", "max"),
                                        ("val_auroc", "max"), ("f1", "max"), ("val_r2_score", "max"), ("mae", "min")])
def test_auto_mode_maximizes_accuracy_like_names(name, mode):
    assert Monitor(name).mode == mode


def test_bad_mode_is_rejected():
    with pytest.raises(ValueError, match="mode must be 'auto', 'min' or 'max'"):
        EarlyStopping(mode="lowest")


def test_resuming_continues_early_stopping_and_checkpointing_exactly(overshoot, tmp_path):
    """ModelCheckpoint listed first still saves EarlyStopping's state of the epoch it saves."""
    def callbacks(directory):
        return [ModelCheckpoint(directory / "e{epoch}.pt"), EarlyStopping(patience=3, restore_best_weights=True)]

    straight_callbacks = callbacks(tmp_path)
    straight = sgd_model()
    expected = fit(straight, overshoot, 50, straight_callbacks)
    best = straight_callbacks[1].best_epoch
    resume_epoch = best + 2   # after the best epoch: the resumed run must remember it, its weights and the waiting
    resumed_dir = tmp_path / "resumed"
    resumed_callbacks = callbacks(resumed_dir)
    resumed = sgd_model(nn.Linear(4, 1))
    history = fit(resumed, overshoot, 50, resumed_callbacks, resume_from=tmp_path / f"e{resume_epoch}.pt")
    assert history.history == expected.history and len(history.epoch) == len(expected.epoch)
    assert resumed_callbacks[1].state_dict()["best_epoch"] == best
    assert resumed_callbacks[1].stopped_epoch == straight_callbacks[1].stopped_epoch
    torch.testing.assert_close(resumed.net.state_dict(), straight.net.state_dict(), rtol=0, atol=0)
    assert sorted(p.name for p in resumed_dir.iterdir()) == sorted(
        f"e{epoch + 1}.pt" for epoch in expected.epoch[resume_epoch:])


# --- ModelCheckpoint ------------------------------------------------------------------------
def test_model_checkpoint_writes_formatted_names_that_load(overshoot, tmp_path):
    snapshots = WeightSnapshots()
    model = sgd_model()
    history = fit(model, overshoot, 3, [snapshots, ModelCheckpoint(tmp_path / "ckpt-{epoch:02d}-{val_loss:.3f}.pt")])
    names = [f"ckpt-{epoch + 1:02d}-{loss:.3f}.pt" for epoch, loss in zip(history.epoch, history.history["val_loss"])]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(names), "exactly the checkpoints, no temp files"
    for epoch, name in enumerate(names):
        loaded = easyfit.Model.load(tmp_path / name, net=nn.Linear(4, 1))
        torch.testing.assert_close(loaded.net.state_dict(), snapshots.weights[epoch], rtol=0, atol=0)
        assert loaded.completed_epochs == epoch + 1 and len(loaded.history.epoch) == epoch + 1


def test_save_best_only_writes_only_on_improvement(overshoot, tmp_path):
    snapshots = WeightSnapshots()
    history = fit(sgd_model(), overshoot, 12, [snapshots, ModelCheckpoint(tmp_path / "best-{epoch}.pt",
                                                                          save_best_only=True, verbose=1)])
    val_losses = history.history["val_loss"]
    improved = [epoch for epoch, loss in enumerate(val_losses) if loss < min(val_losses[:epoch], default=math.inf)]
    assert len(improved) < len(val_losses)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(f"best-{epoch + 1}.pt" for epoch in improved)
    best = improved[-1]
    loaded = easyfit.Model.load(tmp_path / f"best-{best + 1}.pt", net=nn.Linear(4, 1))
    torch.testing.assert_close(loaded.net.state_dict(), snapshots.weights[best], rtol=0, atol=0)


def test_save_best_only_to_one_path_keeps_the_best(overshoot, tmp_path):
    """mode="max" on a loss keeps the worst epoch: the mode is honoured."""
    snapshots = WeightSnapshots()
    history = fit(sgd_model(), overshoot, 12, [snapshots, ModelCheckpoint(tmp_path / "best.pt", monitor="val_loss",
                                                                          save_best_only=True, mode="max")])
    worst = history.history["val_loss"].index(max(history.history["val_loss"]))
    loaded = easyfit.Model.load(tmp_path / "best.pt", net=nn.Linear(4, 1))
    torch.testing.assert_close(loaded.net.state_dict(), snapshots.weights[worst], rtol=0, atol=0)
    assert [p.name for p in tmp_path.iterdir()] == ["best.pt"]


def test_model_checkpoint_every_n_batches(regression, tmp_path):
    sgd_model().fit(*regression, epochs=2, batch_size=16, verbose=0,
                    callbacks=[ModelCheckpoint(tmp_path / "e{epoch}-b{batch}.pt", save_freq=3)])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["e1-b3.pt", "e2-b2.pt"]   # batches 3 and 6 of 4 per epoch


def test_model_checkpoint_explains_an_unknown_field(regression, tmp_path):
    with pytest.raises(ValueError, match=r"cannot fill in the filepath .*\{acc\}.*fields: loss, epoch"):
        sgd_model().fit(*regression, epochs=1, verbose=0, callbacks=[ModelCheckpoint(tmp_path / "{acc}.pt")])
    with pytest.raises(ValueError, match="save_freq must be 'epoch' or a positive number"):
        ModelCheckpoint("x.pt", save_freq=0)


# --- LearningRateScheduler ------------------------------------------------------------------
class LearningRates(Callback):
    """Each param group's LR seen by the optimizer during each epoch."""

    def __init__(self):
        self.lrs: list[list[float]] = []

    def on_train_batch_begin(self, batch, logs=None):
        if batch == 0:
            self.lrs.append([group["lr"] for group in self.model.optimizer.param_groups])


def test_lr_scheduler_sets_the_lr_each_epoch_and_logs_it(regression):
    seen = LearningRates()
    history = sgd_model(lr=0.1).fit(*regression, epochs=3, verbose=0, callbacks=[
        LearningRateScheduler(lambda epoch, lr: 0.1 * 0.5 ** epoch), seen])
    assert seen.lrs == [[0.1], [0.05], [0.025]]
    assert history.history["learning_rate"] == [0.1, 0.05, 0.025]


def test_lr_scheduler_schedules_each_param_group_from_its_own_lr(regression):
    def two_groups(params):
        weight, bias = params
        return torch.optim.SGD([{"params": [weight], "lr": 0.1}, {"params": [bias], "lr": 0.01}])

    seen = LearningRates()
    model = easyfit.Model(zero_linear(), "mse", two_groups)
    history = model.fit(*regression, epochs=2, verbose=0,
                        callbacks=[LearningRateScheduler(lambda epoch, lr: lr / 2), seen])
    assert seen.lrs == [[0.05, 0.005], [0.025, 0.0025]]
    assert history.history["learning_rate"] == [0.05, 0.025]


def test_lr_scheduler_speaks_the_users_lr_scale():
    """When fit scales the LR for a larger effective batch, the schedule sees and returns unscaled LRs: the
    optimizer holds them, and each step takes them times the scale (tests/parts/test_lr_scaling.py)."""
    model = sgd_model(lr=0.1)
    scheduler = LearningRateScheduler(lambda epoch, lr: lr + 0.1)
    scheduler.set_model(model)
    scheduler.set_params({"lr_multiplier": 4.0})
    logs: dict = {}
    scheduler.on_epoch_begin(0, logs)
    assert logs["learning_rate"] == pytest.approx(0.2) and model.optimizer.param_groups[0]["lr"] == pytest.approx(0.2)


def test_lr_scheduler_rejects_a_schedule_that_returns_no_number(regression):
    with pytest.raises(TypeError, match=r"schedule\(0, lr\) must return a number, got None"):
        sgd_model().fit(*regression, epochs=1, verbose=0, callbacks=[LearningRateScheduler(lambda epoch, lr: None)])


# --- CSVLogger ------------------------------------------------------------------------------
def read_csv(path) -> list[dict]:
    with open(path, newline="") as file:
        return list(csv.DictReader(file, delimiter=";"))


def test_csv_logger_rows_equal_the_history_and_append_continues(overshoot, tmp_path):
    path = tmp_path / "log.csv"
    history = fit(sgd_model(), overshoot, 3, [LearningRateScheduler(lambda epoch, lr: lr), CSVLogger(path, ";")])
    rows = read_csv(path)
    assert list(rows[0]) == ["epoch", "loss", "val_loss", "learning_rate"]
    assert [int(row["epoch"]) for row in rows] == history.epoch
    assert {key: [float(row[key]) for row in rows] for key in history.history} == history.history
    fit(sgd_model(), overshoot, 2, [LearningRateScheduler(lambda epoch, lr: lr), CSVLogger(path, ";", append=True)])
    appended = read_csv(path)
    assert appended[:3] == rows and [row["epoch"] for row in appended] == ["0", "1", "2", "0", "1"]


def test_csv_logger_adds_a_column_that_appears_later(overshoot, tmp_path):
    path = tmp_path / "log.csv"
    history = fit(sgd_model(), overshoot, 4, [CSVLogger(path, ";")], validation_freq=2)
    rows = read_csv(path)
    assert list(rows[0]) == ["epoch", "loss", "val_loss"] and len(rows) == 4
    assert [row["val_loss"] for row in rows[::2]] == ["", ""]
    assert [float(row["val_loss"]) for row in rows[1::2]] == history.history["val_loss"]
    assert [float(row["loss"]) for row in rows] == history.history["loss"]


# --- TerminateOnNaN -------------------------------------------------------------------------
def test_terminate_on_nan_stops_and_reports_the_step(regression):
    calls = 0

    def loss_nan_at_step_6(output, target):
        nonlocal calls
        calls += torch.is_grad_enabled()   # training steps only (fit's check of the first batch runs without grad)
        loss = functional.mse_loss(output, target)
        return loss * math.nan if calls == 6 else loss

    terminate = TerminateOnNaN()
    model = easyfit.Model(zero_linear(), loss_nan_at_step_6, "sgd")
    with pytest.warns(RuntimeWarning, match="training loss is nan"):
        history = model.fit(*regression, epochs=5, batch_size=16, verbose=0, callbacks=[terminate])
    assert calls == 6 and model.stop_training and len(history.epoch) == 2   # 4 batches per epoch
    assert terminate.message == ("TerminateOnNaN: the training loss is nan at epoch 2, batch 2 (training step 6); "
                                 "training stopped")


def test_terminate_on_nan_lets_a_healthy_run_finish(regression):
    terminate = TerminateOnNaN()
    history = sgd_model().fit(*regression, epochs=2, verbose=0, callbacks=[terminate])
    assert len(history.epoch) == 2 and terminate.message is None


class ToldOfExceptions(Callback):
    def __init__(self, fail_in: str):
        self.fail_in, self.told = fail_in, []

    def on_train_batch_end(self, batch, logs=None):
        if self.fail_in == "fit":
            raise ValueError("in fit")

    def on_test_batch_end(self, batch, logs=None):
        if self.fail_in == "evaluate":
            raise ValueError("in evaluate")

    def on_predict_batch_end(self, batch, logs=None):
        if self.fail_in == "predict":
            raise ValueError("in predict")

    def on_exception(self, exception):
        self.told.append(str(exception))


@pytest.mark.parametrize("call", ["fit", "evaluate", "predict"])
def test_an_exception_is_told_to_the_callbacks_once_before_it_reaches_the_caller(call):
    model = easyfit.Model(nn.Linear(4, 2), "cross_entropy", "sgd")
    x, y = torch.zeros(8, 4), torch.zeros(8, dtype=torch.long)
    callback = ToldOfExceptions(call)
    run = {"fit": lambda: model.fit(x, y, epochs=1, batch_size=4, validation_data=(x, y), callbacks=[callback]),
           "evaluate": lambda: model.evaluate(x, y, callbacks=[callback]),
           "predict": lambda: model.predict(x, callbacks=[callback])}[call]
    with pytest.raises(ValueError, match=f"in {call}"):
        run()
    assert callback.told == [f"in {call}"]
