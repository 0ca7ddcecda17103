"""easyfit on a Ray cluster: the same fit call, run as a Ray Train TorchTrainer (launcher="ray"), then a Ray Tune
search whose ASHA scheduler stops the unpromising trials early (easyfit.callbacks.TuneReport).

    pip install "easyfit[ray]"
    python examples/ray_cluster.py                     # a local Ray cluster, started for the run
    RAY_ADDRESS=head:6379 python examples/ray_cluster.py   # an existing cluster (ray start --head there)

docs/ray.md explains what runs where."""
from __future__ import annotations

import argparse
import os
import tempfile

import ray
import torch
from ray import tune
from ray.tune.schedulers import ASHAScheduler
from torch import nn

import easyfit
from easyfit.callbacks import TuneReport


def make_data(samples: int = 512):
    """Points inside or outside a circle: a small nonlinear classification task."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(samples, 2, generator=generator)
    return x, (x.norm(dim=1) > 1.2).long()


def make_model(lr: float) -> easyfit.Model:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(2, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 2))
    return easyfit.Model(net, loss="cross_entropy", optimizer="sgd", lr=lr, metrics=["accuracy"])


def trial(config: dict) -> None:
    """One Tune trial: a one-process fit reporting every epoch to Tune (ASHA may stop it after any epoch)."""
    x, y = make_data()
    make_model(config["lr"]).fit(x[:384], y[:384], validation_data=(x[384:], y[384:]), epochs=config["epochs"],
                                 batch_size=32, verbose=0, callbacks=[TuneReport()])


def fit_then_search(epochs: int, storage: str) -> None:
    """A 2-worker fit on the cluster, then a learning-rate search, both keeping their files under `storage`."""
    # 1. the fit of a laptop, on the cluster: 2 workers (processes) under DDP, whose process group Ray makes
    x, y = make_data()
    model = make_model(0.3)
    history = model.fit(x[:384], y[:384], epochs=epochs, batch_size=32, verbose=2, devices=2, strategy="ddp",
                        launcher=easyfit.launchers.Ray(storage_path=storage))
    losses = history.history["loss"]
    loss, accuracy = model.evaluate(x[384:], y[384:], verbose=0)   # the trained weights are in this process
    print(f"launcher='ray': loss {losses[0]:.4f} -> {losses[-1]:.4f}, test accuracy {accuracy:.3f}")

    # 2. a search over the learning rate: 4 trials, two at a time; ASHA stops the bad ones at its rungs
    tuner = tune.Tuner(
        trial, param_space={"lr": tune.grid_search([0.3, 0.1, 0.001, 0.0001]), "epochs": epochs},
        tune_config=tune.TuneConfig(metric="val_loss", mode="min", max_concurrent_trials=2,
                                    scheduler=ASHAScheduler(time_attr="epoch", max_t=epochs, grace_period=1,
                                                            reduction_factor=2)),
        run_config=tune.RunConfig(storage_path=storage, name="lr-search", verbose=0))
    results = tuner.fit()
    epochs_run = [int(result.metrics["epoch"]) for result in results]
    best = results.get_best_result()
    print(f"tune: epochs run per trial {epochs_run}; stopped early: {sum(e < epochs for e in epochs_run)}")
    print(f"tune: best lr {best.config['lr']} (val_loss {best.metrics['val_loss']:.4f})")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=8)
    args = parser.parse_args()
    if "RAY_ADDRESS" not in os.environ:   # a local cluster for this run, without Ray's dashboard
        ray.init(include_dashboard=False)
    with tempfile.TemporaryDirectory(prefix="easyfit-ray-") as storage:   # the runs' checkpoints and Tune's state
        fit_then_search(args.epochs, storage)


if __name__ == "__main__":
    main()
