"""A mid-epoch resume restores the epoch's metrics with its loss (the History equals an uninterrupted run's), the
metric states of several ranks merge on another world size, and every attempt of a restarted call starts from the
caller's state. The multi-process runs are in tests/distributed/test_fault_tolerance.py."""
from __future__ import annotations

import warnings

import pytest
import torch

import easyfit
from easyfit.callbacks import BackupAndRestore, Callback, ModelCheckpoint
from easyfit.distributed import fault_tolerance
from easyfit.distributed.launchers.base import Launcher
from easyfit.distributed.launchers.restarts import RestartingLauncher
from easyfit.distributed.strategies.base import Strategy
from easyfit.parts import metric_state
from easyfit.parts.metrics import MetricSet
from easyfit.saving.resume import EpochPosition
from easyfit.training.running_call import RunningCall

METRICS = ["accuracy", "f1", "auroc"]   # states reduced by sum (accuracy, f1) and by cat (auroc)


def _model(make_net) -> easyfit.Model:
    net = make_net(dropout=0.3)
    return easyfit.Model(net, "cross_entropy", "adam", metrics=METRICS, lr=0.01, scheduler_interval="step",
                         scheduler=lambda optimizer: torch.optim.lr_scheduler.StepLR(optimizer, 4, gamma=0.9))


def _fit(model, x, y, callbacks, resume_from=None):
    torch.manual_seed(7 if resume_from is None else 99)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "resuming: no callback of this fit takes", RuntimeWarning)
        return model.fit(x, y, epochs=3, batch_size=16, seed=3, verbose=0, callbacks=callbacks,
                         validation_data=(x[:30], y[:30]), resume_from=resume_from)


def _assert_same_history(actual: dict, expected: dict) -> None:
    assert actual.keys() == expected.keys()
    for key, values in expected.items():
        assert actual[key] == pytest.approx(values, abs=1e-6), key


def test_a_mid_epoch_checkpoint_resumes_the_epochs_metrics_with_its_loss(make_net, classification, tmp_path):
    x, y = classification
    straight = _fit(_model(make_net), x, y, [ModelCheckpoint(str(tmp_path / "ck-{epoch}-{batch}.pt"), save_freq=5)])
    for name in ("ck-1-5.pt", "ck-2-3.pt"):   # 7 batches an epoch
        resumed = _fit(_model(make_net), x, y, [], resume_from=tmp_path / name)
        _assert_same_history(resumed.history, straight.history)
    assert "counts only" not in resumed.params["summary"]


def test_a_checkpoint_without_metric_states_says_what_the_resumed_epochs_metrics_count(make_net, classification,
                                                                                        tmp_path):
    """A mid-epoch checkpoint written before checkpoints held the metrics' state: the metrics start the rest of the
    epoch empty (not with what an evaluate left in them), and the summary line says so."""
    x, y = classification
    _fit(_model(make_net), x, y, [ModelCheckpoint(str(tmp_path / "ck-{epoch}-{batch}.pt"), save_freq=5)])
    state = torch.load(tmp_path / "ck-2-3.pt", weights_only=True)
    del state["position"]["metrics"]
    torch.save(state, tmp_path / "old.pt")
    model = _model(make_net)
    model.evaluate(x, y, verbose=0)
    resumed = _fit(model, x, y, [], resume_from=tmp_path / "old.pt")
    assert resumed.params["summary"].endswith("; epoch 2's accuracy, f1, auroc count only the batches after the resume")
    _assert_same_history(resumed.history, _fit(_model(make_net), x, y, [], resume_from=tmp_path / "old.pt").history)


class CrashOnce(Callback):
    """Raises after batch 5 of the second epoch, the first time only."""

    may_stop_training = False

    def __init__(self):
        self.armed, self.epoch = True, 0

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if self.armed and (self.epoch, batch) == (1, 5):
            self.armed = False
            raise RuntimeError("simulated crash")


def test_a_backup_every_n_batches_resumes_mid_epoch_with_the_whole_history(make_net, classification, tmp_path):
    x, y = classification
    expected = _fit(_model(make_net), x, y, [])
    crash = CrashOnce()
    with pytest.raises(RuntimeError, match="simulated crash"):
        _fit(_model(make_net), x, y, [BackupAndRestore(tmp_path, save_freq=4), crash])
    assert torch.load(tmp_path / "backup.pt", weights_only=True)["position"]["batches_done"] == 5   # the 12th batch
    history = _fit(_model(make_net), x, y, [BackupAndRestore(tmp_path, save_freq=4), crash])
    _assert_same_history(history.history, expected.history)
    assert not (tmp_path / "backup.pt").exists()


@pytest.mark.parametrize("save_freq", [0, "batch", True])
def test_a_backup_frequency_is_epoch_or_a_number_of_batches(tmp_path, save_freq):
    with pytest.raises(ValueError, match="BackupAndRestore: save_freq must be 'epoch' or a positive number of "
                                         "batches"):
        BackupAndRestore(tmp_path, save_freq=save_freq)


def mean_of_outputs():
    """A user's torchmetrics metric whose state is reduced by a mean over the ranks: no merge of two ranks' states
    can be exact (the calling test skips without torchmetrics)."""
    torchmetrics = pytest.importorskip("torchmetrics")

    class MeanOfOutputs(torchmetrics.Metric):
        def __init__(self):
            super().__init__()
            self.add_state("value", default=torch.tensor(0.0), dist_reduce_fx="mean")

        def update(self, output, target):
            self.value = output.float().mean()

        def compute(self):
            return self.value

    return MeanOfOutputs()


def _ranks(x, y, metrics, parts: int) -> list[dict]:
    """The states `parts` ranks would save, each having seen its share of (x, y)."""
    states = []
    for share in range(parts):
        ranks_metrics = MetricSet(metrics, torch.nn.CrossEntropyLoss())
        ranks_metrics.update(torch.nn.functional.one_hot(x[share::parts], 3).float(), y[share::parts])
        states.append(metric_state.rank_state(ranks_metrics))
    return states


def test_states_of_two_ranks_merge_into_one_exactly_and_a_mean_is_named():
    generator = torch.Generator().manual_seed(0)
    predicted, y = torch.randint(0, 3, (40,), generator=generator), torch.randint(0, 3, (40,), generator=generator)
    whole = MetricSet(METRICS, torch.nn.CrossEntropyLoss())
    whole.update(torch.nn.functional.one_hot(predicted, 3).float(), y)
    expected = whole.compute()

    metrics = MetricSet(METRICS, torch.nn.CrossEntropyLoss())
    saved = _ranks(predicted, y, METRICS, parts=2)
    assert metric_state.restore(metrics, saved, rank=0, world_size=1, device=torch.device("cpu")) == []
    assert metrics.task == whole.task and metrics.compute() == pytest.approx(expected, abs=1e-7)
    assert metrics.compute() != pytest.approx(_metrics_of(predicted[0::2], y[0::2]).compute(), abs=1e-7)

    on_two = MetricSet(METRICS, torch.nn.CrossEntropyLoss())   # the same world: rank 1 gets its own state back
    metric_state.restore(on_two, saved, rank=1, world_size=2, device=torch.device("cpu"))
    assert on_two.compute() == pytest.approx(_metrics_of(predicted[1::2], y[1::2]).compute(), abs=1e-7)

    custom = {"accuracy": "accuracy", "mean_of_outputs": mean_of_outputs()}
    saved = _ranks(predicted, y, custom, parts=2)
    again = MetricSet({"accuracy": "accuracy", "mean_of_outputs": mean_of_outputs()}, torch.nn.CrossEntropyLoss())
    assert metric_state.restore(again, saved, rank=0, world_size=1, device=torch.device("cpu")) == ["mean_of_outputs"]
    assert not again.metrics["mean_of_outputs"].update_called and again.metrics["accuracy"].update_called


def _metrics_of(predicted, y) -> MetricSet:
    metrics = MetricSet(METRICS, torch.nn.CrossEntropyLoss())
    metrics.update(torch.nn.functional.one_hot(predicted, 3).float(), y)
    return metrics


def test_the_summary_line_says_which_metrics_count_only_the_batches_after_the_restart(make_net):
    model = easyfit.Model(make_net(), "cross_entropy", "sgd", lr=0.1)
    model.running = RunningCall(Strategy(), model.precision)
    model.completed_epochs, model.position = 1, EpochPosition(batches_done=3)
    model.position.inexact_metrics = ["mean_of_outputs"]
    run = fault_tolerance.RestartableFit("torchrun", "unused", restart=1, resume_from="unused")
    state = {fault_tolerance.WORLD_KEY: {"world_size": 1, "batch_factor": 1}}
    note = fault_tolerance.resume_note(model, run, state, batch_size=16, accumulate=1, multiplier=1.0)
    assert note == ("resumed after restart 1 from epoch 2, step 3; epoch 2's mean_of_outputs counts only the batches "
                    "after the restart")


class Count(Callback):
    """A callback without a state_dict: its count is what the caller's object holds."""

    may_stop_training = False

    def __init__(self):
        self.count = 0

    def on_train_batch_end(self, batch, logs=None):
        self.count += 1


class InThisProcess(Launcher):
    """Runs every attempt here, as the script re-run runs rank 0 in the caller's process."""

    def start(self, function, *args, **kwargs):
        return function(*args, **kwargs)


def test_every_attempt_starts_from_the_callers_state_before_the_first(make_net, classification):
    """Before the fix, the second attempt started with the first one's weights, optimizer state, built metrics,
    callback count and random state."""
    x, y = classification
    model, count = easyfit.Model(make_net(), "cross_entropy", "adam", metrics=["accuracy"]), Count()
    seen = []

    def attempt():
        seen.append(({key: value.clone() for key, value in model.net.state_dict().items()}, dict(model.metrics.pending),
                     model.metrics.task, count.count, len(model.optimizer.state), torch.get_rng_state()))
        if len(seen) == 1:   # the first attempt trains, then fails
            model.fit(x, y, epochs=1, verbose=0, callbacks=[count])
            raise RuntimeError("attempt 1 fails")
        return "done"

    assert RestartingLauncher(InThisProcess(), Strategy(), 1, model, [count]).start(attempt) == "done"
    (weights, *rest, rng), (weights_again, *rest_again, rng_again) = seen
    assert rest == rest_again == [{"accuracy": "accuracy"}, None, 0, 0]
    assert torch.equal(rng, rng_again)
    for key, value in weights.items():
        assert torch.equal(weights_again[key], value), key
