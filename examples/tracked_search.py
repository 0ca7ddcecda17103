"""A tracked, EMA-averaged, pruned hyperparameter search on scikit-learn's digits.

Each Optuna trial fits a small MLP with easyfit: MLflowLogger records the trial's settings and every epoch in an
MLflow run, EMA averages the weights (validation scores the averages), and OptunaPruning stops a trial whose
validation loss falls behind the median of the earlier ones at the same epoch (fit raises optuna.TrialPruned).

    pip install easyfit[mlflow,optuna] scikit-learn
    python examples/tracked_search.py [--trials 6] [--epochs 6] [--out tracked_search]

The MLflow store is OUT/mlflow.db: `mlflow ui --backend-store-uri sqlite:///OUT/mlflow.db` shows the runs.
"""
import argparse
import os

import optuna
import torch
from mlflow.tracking import MlflowClient
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import nn

import easyfit
from easyfit.callbacks import EMA, MLflowLogger, OptunaPruning


def data():
    digits = load_digits()
    x = torch.tensor(digits.data / 16.0, dtype=torch.float32)
    y = torch.tensor(digits.target)
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.2, random_state=0, stratify=y)
    return x_train, y_train, x_test, y_test


def net(hidden: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, 10))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--trials", type=int, default=6)
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--out", default="tracked_search")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    uri = f"sqlite:///{os.path.abspath(args.out)}/mlflow.db"
    x_train, y_train, x_test, y_test = data()
    optuna.logging.set_verbosity(optuna.logging.WARNING)

    def objective(trial: optuna.Trial) -> float:
        lr = trial.suggest_float("lr", 1e-5, 3e-2, log=True)
        hidden = trial.suggest_categorical("hidden", [32, 64])
        model = easyfit.Model(net(hidden), "cross_entropy", "adam", metrics=["accuracy"], lr=lr)
        logger = MLflowLogger(experiment="digits", run_name=f"trial-{trial.number}", tracking_uri=uri)
        try:
            history = model.fit(x_train, y_train, batch_size=64, epochs=args.epochs, verbose=0,
                                validation_split=0.2, callbacks=[logger, EMA(decay=0.9), OptunaPruning(trial)])
        except optuna.TrialPruned:
            print(f"trial {trial.number}: lr {lr:.2g}, hidden {hidden}: pruned after epoch "
                  f"{model.completed_epochs}")
            raise
        trial.set_user_attr("run_id", logger.run_id)
        print(f"trial {trial.number}: lr {lr:.2g}, hidden {hidden}: val_accuracy "
              f"{history.history['val_accuracy'][-1]:.3f}")
        return history.history["val_loss"][-1]

    study = optuna.create_study(sampler=optuna.samplers.TPESampler(seed=0),
                                pruner=optuna.pruners.MedianPruner(n_startup_trials=2, n_warmup_steps=0))
    study.enqueue_trial({"lr": 1e-2, "hidden": 64})   # two sound starting points, then one that cannot learn in
    study.enqueue_trial({"lr": 3e-3, "hidden": 32})   # time: the pruner stops it after its first epoch
    study.enqueue_trial({"lr": 1e-5, "hidden": 32})
    study.optimize(objective, n_trials=args.trials)

    pruned = [t for t in study.trials if t.state == optuna.trial.TrialState.PRUNED]
    client = MlflowClient(tracking_uri=uri)
    runs = client.search_runs([client.get_experiment_by_name("digits").experiment_id])
    print(f"pruned {len(pruned)} of {len(study.trials)} trials; MLflow holds {len(runs)} runs in {uri}")
    best = study.best_trial
    print(f"best trial {best.number}: {best.params}, MLflow run {best.user_attrs['run_id']}")
    model = easyfit.Model(net(best.params["hidden"]), "cross_entropy", "adam", metrics=["accuracy"],
                          lr=best.params["lr"])
    model.fit(x_train, y_train, batch_size=64, epochs=args.epochs, verbose=0, callbacks=[EMA(decay=0.9)])
    print(f"best settings, EMA weights: test accuracy {model.evaluate(x_test, y_test, verbose=0)[1]:.4f}")


if __name__ == "__main__":
    main()
