"""OptunaPruning with a real in-memory study and MedianPruner: a deliberately bad trial is pruned after its first
epoch and fit raises optuna.TrialPruned to the objective; the same with every fit on 2 processes (ddp: every rank
runs the script and stops at the same epoch; ddp_spawn: rank 0 runs in another process, its reports reach the
caller's trial)."""
from __future__ import annotations

import pytest
import torch
from around_helpers import NEEDS_OPTUNA, make_data, make_net, run_around

import easyfit
from easyfit.callbacks import OptunaPruning

pytestmark = NEEDS_OPTUNA


def search(fit_options: dict) -> tuple:
    import optuna
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(pruner=optuna.pruners.MedianPruner(n_startup_trials=2, n_warmup_steps=0))
    for lr in (0.5, 0.5, 1e-6):   # two good trials, then one that cannot learn
        study.enqueue_trial({"lr": lr})
    epochs, raised = {}, []
    x, y = make_data()

    def objective(trial):
        net = make_net()
        model = easyfit.Model(net, "cross_entropy", torch.optim.SGD(net.parameters(),
                                                                    lr=trial.suggest_float("lr", 1e-6, 1.0, log=True)))
        try:
            history = model.fit(x, y, batch_size=16, epochs=4, shuffle=False, verbose=0, lr_scaling=None,
                                validation_data=(x[:64], y[:64]), callbacks=[OptunaPruning(trial)], **fit_options)
        except optuna.TrialPruned:
            raised.append(trial.number)
            raise
        finally:
            epochs[trial.number] = model.completed_epochs
        return history.history["val_loss"][-1]

    study.optimize(objective, n_trials=3)
    return [(t.number, t.state.name, dict(t.intermediate_values)) for t in study.trials], epochs, raised


def check_pruned(trials: list, epochs: dict) -> None:
    states = [state for _, state, _ in trials]
    assert states == ["COMPLETE", "COMPLETE", "PRUNED"]
    assert list(trials[0][2]) == [0, 1, 2, 3] and list(trials[2][2]) == [0]   # reported each epoch; pruned after 1
    assert trials[2][2][0] > trials[0][2][0]
    assert epochs == {0: 4, 1: 4, 2: 1}


def test_a_bad_trial_is_pruned_and_fit_raises_trial_pruned():
    trials, epochs, raised = search({})
    check_pruned(trials, epochs)
    assert raised == [2]


def test_every_epoch_without_validation_reports_nothing():
    import optuna
    study = optuna.create_study()
    trial = study.ask()
    net = make_net()
    x, y = make_data()
    model = easyfit.Model(net, "cross_entropy", "sgd")
    with pytest.warns(RuntimeWarning, match="'val_loss' is not in the logs"):
        model.fit(x, y, epochs=1, verbose=0, callbacks=[OptunaPruning(trial)])
    assert study.trials[0].intermediate_values == {}
    with pytest.raises(TypeError, match="the optuna Trial"):
        OptunaPruning(study)


@pytest.mark.timeout(600)
def test_ddp_every_rank_stops_at_the_same_epoch(ddp_around):
    """Each rank of the script runs its own study; rank 0's pruner decides, every rank stops after epoch 1 and
    raises, so both studies end alike."""
    rank0, rank1 = ddp_around["optuna"]
    check_pruned(rank0["trials"], rank0["epochs"])
    assert rank1["trials"] == rank0["trials"] and rank1["epochs"] == rank0["epochs"]


@pytest.mark.timeout(600)
def test_ddp_spawn_reports_reach_the_callers_trial(tmp_path):
    (outcome,) = run_around(tmp_path, "ddp_spawn", ["optuna"])["optuna"]
    check_pruned(outcome["trials"], outcome["epochs"])
