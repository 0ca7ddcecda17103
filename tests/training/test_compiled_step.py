"""fit(compile=...) running the whole step as one program, N steps per call (steps_per_execution): eager's numbers.

The nets are smooth (Tanh) and trained by SGD, so a difference of rounding stays one. Most runs compile with
torch's "aot_eager" backend (the same traced program, in seconds); inductor's own numbers are checked on two."""
from __future__ import annotations

import pytest
import torch
from compile_paths import fast_path
from nets import mean_of_batch_maxima
from torch import nn

import easyfit
from easyfit.callbacks import Callback, ModelCheckpoint
from easyfit.callbacks.base import CallbackList
from easyfit.compiled.multi_step import AUTO_STEPS, steps_per_call

pytestmark = fast_path   # the whole step as one program

TRACED = {"backend": "aot_eager"}


def smooth_net(dropout: float = 0.0, batch_norm: bool = False) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), *([nn.BatchNorm1d(8)] if batch_norm else []), nn.Tanh(),
                         *([nn.Dropout(dropout)] if dropout else []), nn.Linear(8, 3))


class BatchHooks(Callback):
    """The batch indices the training batch hooks saw, per epoch."""

    def __init__(self):
        self.begins, self.ends = [], []

    def on_epoch_begin(self, epoch, logs=None):
        self.begins.append([])
        self.ends.append([])

    def on_train_batch_begin(self, batch, logs=None):
        self.begins[-1].append(batch)

    def on_train_batch_end(self, batch, logs=None):
        self.ends[-1].append(batch)


def _fit(data, compile, optimizer="sgd", net=None, epochs=2, seed=1, **options):
    torch.manual_seed(seed)
    model = easyfit.Model(net or smooth_net(), "cross_entropy", optimizer, metrics=["accuracy"], lr=0.1)
    history = model.fit(*data, epochs=epochs, batch_size=16, verbose=0, compile=compile, devices=1, **options)
    return model, history.history


def _programs(model) -> list:
    """The whole-step programs the Model compiled: (steps per call, callable directly once its guards pass)."""
    return [(len(key.steps), bool(program.direct)) for value in model.compiled_steps.cache.values()
            if isinstance(value, dict) for key, program in value.items()]


def _assert_equal(eager, compiled, atol=1e-5) -> None:
    (eager_model, eager_history), (model, history) = eager, compiled
    for (name, expected), actual in zip(eager_model.net.state_dict().items(), model.net.state_dict().values()):
        assert (actual - expected).abs().max().item() <= atol, name
    for key, values in eager_history.items():
        assert history[key] == pytest.approx(values, abs=atol), key


def test_inductor_runs_each_step_as_one_program_with_eager_numbers(classification):
    """101 samples in batches of 16: batch 0 runs eagerly (the first-batch checks), 1-3 and 4-6 in programs of
    three steps except the short last batch 6, which runs eagerly; 4 and 5 then run one step per call."""
    eager = _fit(classification, False)
    compiled = _fit(classification, True, steps_per_execution=3)
    _assert_equal(eager, compiled)
    assert sorted(_programs(compiled[0])) == [(1, True), (3, True)]   # called straight, the outputs for metrics too


def test_inductor_draws_eager_dropout_masks(classification):
    """inductor's fallback_random: the compiled fit's Dropout masks are eager's (without it they differ by 5e-2)."""
    eager = _fit(classification, False, net=smooth_net(0.3))
    compiled = _fit(classification, True, net=smooth_net(0.3), steps_per_execution=1)
    _assert_equal(eager, compiled)


@pytest.mark.parametrize("options", [
    {"gradient_accumulation_steps": 2, "gradient_clip_val": 0.05},
    {"lr_warmup_epochs": 1, "scheduler": "step"},
    {"class_weight": {0: 0.5, 2: 3.0}},
    {"sample_weight": torch.linspace(0.1, 2.0, 101)},
    {"precision": "bf16-mixed"},
    {"optimizer": "adam"},
    {"optimizer": "adamw", "steps_per_execution": 1},
    {"batch_norm": True},
], ids=["accumulate-clip", "warmup-schedule", "class-weight", "sample-weight", "bf16-mixed", "adam", "adamw",
        "batch-norm"])
def test_traced_steps_match_eager_within_1e_5(classification, options):
    options = {"steps_per_execution": 2, **options}
    optimizer = options.pop("optimizer", "sgd")
    step_schedule = options.pop("scheduler", None)
    batch_norm = options.pop("batch_norm", False)   # its running statistics are updated inside the program

    def run(compile):
        torch.manual_seed(1)
        schedule = step_schedule and (lambda o: torch.optim.lr_scheduler.StepLR(o, 3, 0.5))
        model = easyfit.Model(smooth_net(batch_norm=batch_norm), "cross_entropy", optimizer, metrics=["accuracy"],
                              lr=0.05, scheduler=schedule, scheduler_interval="step" if step_schedule else "epoch")
        kept = {key: value for key, value in options.items() if compile or key != "steps_per_execution"}
        history = model.fit(*classification, epochs=2, batch_size=16, verbose=0, compile=compile, **kept)
        return model, history.history
    atol = 2e-5 if options.get("precision") == "bf16-mixed" else 1e-5
    eager, compiled = run(False), run(TRACED)
    _assert_equal(eager, compiled, atol)
    assert _programs(compiled[0])


def test_batch_hooks_see_every_nth_batch_and_the_history_is_unchanged(classification):
    hooks = BatchHooks()
    model, history = _fit(classification, TRACED, steps_per_execution=3, callbacks=[hooks])
    assert hooks.begins == [[0, 1, 4, 5, 6], [0, 3, 6]]
    assert hooks.ends == [[0, 3, 4, 5, 6], [2, 5, 6]]
    assert len(history["loss"]) == 2 and model.completed_epochs == 2


def test_a_mid_epoch_checkpoint_resumes_to_the_uninterrupted_numbers(classification, tmp_path):
    """ModelCheckpoint counts batches by index: with 2 steps per call it saves after batch 5 (batches 0, 1-2, 3-4),
    and the fit resumed there ends where the uninterrupted one does."""
    straight = _fit(classification, TRACED, steps_per_execution=2,
                    callbacks=[ModelCheckpoint(tmp_path / "e{epoch}-b{batch}.pt", save_freq=4)])
    assert sorted(p.name for p in tmp_path.iterdir())[0] == "e1-b5.pt"
    resumed = _fit(classification, TRACED, seed=7, steps_per_execution=2, resume_from=tmp_path / "e1-b5.pt")
    torch.testing.assert_close(resumed[0].net.state_dict(), straight[0].net.state_dict(), atol=1e-5, rtol=0)
    assert resumed[1]["loss"] == pytest.approx(straight[1]["loss"], abs=1e-5)


def test_metrics_per_call_equal_eager_ones(classification):
    """With 3 steps per call the named metrics take the call's 3 batches in one update, and the user's own metric
    object, whose value depends on the batching, sees them one by one: every value is eager's."""
    def run(compile):
        torch.manual_seed(1)
        metrics = {"accuracy": "accuracy", "f1": "f1", "largest": mean_of_batch_maxima()}
        model = easyfit.Model(smooth_net(), "cross_entropy", "sgd", metrics=metrics, lr=0.1)
        history = model.fit(*classification, epochs=2, batch_size=16, validation_split=0.2, verbose=0,
                            compile=compile, **({"steps_per_execution": 3} if compile else {}))
        return model, history.history
    eager, compiled = run(False), run(TRACED)
    _assert_equal(eager, compiled)
    assert (3, True) in _programs(compiled[0])


def test_a_second_fit_compiles_nothing(classification):
    model, _ = _fit(classification, TRACED, epochs=1, steps_per_execution=2)
    programs = model.compiled_steps.cache.copy()
    model.fit(*classification, epochs=1, batch_size=16, verbose=0, compile=TRACED, steps_per_execution=2)
    assert _programs(model) == [(len(key.steps), bool(p.direct)) for value in programs.values()
                                if isinstance(value, dict) for key, p in value.items()]


def test_without_metrics_the_program_is_called_straight(classification):
    torch.manual_seed(1)
    model = easyfit.Model(smooth_net(), "cross_entropy", "sgd", lr=0.1)
    model.fit(*classification, epochs=1, batch_size=16, verbose=0, compile=TRACED, steps_per_execution=2)
    assert set(_programs(model)) == {(1, True), (2, True)}
    programs = [program for value in model.compiled_steps.cache.values() if isinstance(value, dict)
                for key, program in value.items() if len(key.steps) == 2]
    assert programs[0].direct_calls == 1   # batches 1-2 through torch.compile, then 3-4 straight

def test_auto_picks_several_steps_for_a_small_net_without_batch_hooks():
    small, large = smooth_net(), nn.Linear(4096, 4096)
    quiet = CallbackList([], None, {})
    assert steps_per_call("auto", quiet, small, 32, 1) == AUTO_STEPS
    assert steps_per_call("auto", quiet, small, 32, 3) == 9   # whole accumulation windows per call
    assert steps_per_call("auto", quiet, large, 32, 1) == 1
    assert steps_per_call("auto", CallbackList([BatchHooks()], None, {}), small, 32, 1) == 1
    assert steps_per_call("auto", CallbackList([ModelCheckpoint("m.pt")], None, {}), small, 32, 1) == AUTO_STEPS
    assert steps_per_call(4, CallbackList([BatchHooks()], None, {}), small, 32, 1) == 4


@pytest.mark.parametrize("options, words", [
    ({"steps_per_execution": 0}, "steps_per_execution must be"),
    ({"steps_per_execution": 2}, "needs compile=True"),
    ({"steps_per_execution": 2, "compile": TRACED, "optimizer": "rmsprop"}, "RMSprop is not traced"),
])
def test_steps_per_execution_that_cannot_run_is_refused_before_training(classification, options, words):
    net = smooth_net()
    before = [p.clone() for p in net.parameters()]
    optimizer = options.pop("optimizer", "sgd")
    with pytest.raises(ValueError, match=words):
        easyfit.Model(net, "cross_entropy", optimizer).fit(*classification, verbose=0, **options)
    assert all(torch.equal(a, b) for a, b in zip(before, net.parameters()))
