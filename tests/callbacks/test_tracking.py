"""MLflowLogger and WandbLogger on the real libraries, read back with their own readers (MLflow's client; W&B's offline
run files) and compared with the History: the settings, every epoch once, per-step values, checkpoints, and the same
run continued by `resume_from` and by an automatic restart after a failed rank (2 CPU processes)."""
from __future__ import annotations

import pytest
import torch
from around_helpers import (
    NEEDS_MLFLOW,
    NEEDS_WANDB,
    hand_ema,
    make_data,
    make_net,
    max_difference,
    run_around,
)
from wandb_files import logged_run, offline_runs

import easyfit
from easyfit.callbacks import MLflowLogger, ModelCheckpoint, WandbLogger


@pytest.fixture(autouse=True)
def offline(tmp_path, monkeypatch):
    """No network, nothing written outside the test's folder (MLflow's default store and W&B's files)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))


def fit(callbacks, epochs=3, **options) -> easyfit.Model:
    x, y = make_data()
    net = make_net()
    model = easyfit.Model(net, "cross_entropy", torch.optim.SGD(net.parameters(), lr=0.1), metrics=["accuracy"])
    model.fit(x, y, batch_size=32, epochs=epochs, shuffle=False, verbose=0, validation_data=(x[:64], y[:64]),
              callbacks=callbacks, **options)
    return model


def mlflow_client(tmp_path):
    from mlflow.tracking import MlflowClient
    return MlflowClient(tracking_uri=f"sqlite:///{tmp_path}/mlflow.db")


def logged(client, run_id: str, key: str) -> list[tuple[int, float]]:
    return sorted((metric.step, metric.value) for metric in client.get_metric_history(run_id, key))


@NEEDS_MLFLOW
def test_mlflow_logs_the_settings_every_epoch_steps_checkpoints_and_the_summary(tmp_path):
    logger = MLflowLogger(experiment="tiny", tracking_uri=f"sqlite:///{tmp_path}/mlflow.db", log_every_n_steps=3,
                          log_checkpoints=True)
    model = fit([logger, ModelCheckpoint(tmp_path / "ckpt-{epoch}.pt", monitor="loss")])
    client, history = mlflow_client(tmp_path), model.history.history
    run = client.get_run(logger.run_id)
    assert run.info.status == "FINISHED"
    assert {key: run.data.params[key] for key in ("epochs", "batch_size", "effective_batch_size", "strategy",
                                                   "world_size", "precision", "lr", "scaled_lr", "optimizer",
                                                   "loss", "parameters")} == {
        "epochs": "3", "batch_size": "32", "effective_batch_size": "32", "strategy": "single", "world_size": "1",
        "precision": "32", "lr": "0.1", "scaled_lr": "0.1", "optimizer": "sgd", "loss": "cross_entropy",
        "parameters": str(model.count_params())}
    for key in ("loss", "accuracy", "val_loss", "val_accuracy"):
        assert logged(client, logger.run_id, key) == [(epoch, pytest.approx(value)) for epoch, value
                                                      in enumerate(history[key])]
    assert [step for step, _ in logged(client, logger.run_id, "batch_loss")] == [3, 6, 9, 12]
    assert run.data.tags["summary"].startswith("effective batch 32")
    assert sorted(item.path for item in client.list_artifacts(logger.run_id, "checkpoints")) == [
        "checkpoints/ckpt-1.pt", "checkpoints/ckpt-2.pt", "checkpoints/ckpt-3.pt"]


@NEEDS_MLFLOW
def test_mlflow_resume_continues_the_run_with_every_epoch_once(tmp_path):
    """The run id travels in the checkpoint (a plain string, loaded as data); the resumed fit logs epochs 3 and 4
    into it. A checkpoint from before the run's last logged epoch (an interrupted run) logs that epoch once."""
    uri, pattern = f"sqlite:///{tmp_path}/mlflow.db", str(tmp_path / "epoch{epoch}.pt")
    first = MLflowLogger(tracking_uri=uri)
    fit([first, ModelCheckpoint(pattern, monitor="loss")], epochs=3)
    assert torch.load(pattern.format(epoch=2), weights_only=True)["callbacks"]["MLflowLogger"]["run_id"] == \
        first.run_id
    resumed = MLflowLogger(tracking_uri=uri)
    model = fit([resumed], epochs=4, resume_from=pattern.format(epoch=2))   # the run already holds epoch 3
    client = mlflow_client(tmp_path)
    assert resumed.run_id == first.run_id
    assert len(client.search_runs(["0"])) == 1
    assert logged(client, first.run_id, "loss") == [(epoch, pytest.approx(value)) for epoch, value
                                                    in enumerate(model.history.history["loss"])]


@NEEDS_MLFLOW
def test_mlflow_a_logger_added_on_resume_logs_the_checkpoints_epochs_too(tmp_path):
    pattern = str(tmp_path / "epoch{epoch}.pt")
    fit([ModelCheckpoint(pattern, monitor="loss")], epochs=2)
    logger = MLflowLogger(tracking_uri=f"sqlite:///{tmp_path}/mlflow.db")
    model = fit([logger], epochs=3, resume_from=pattern.format(epoch=2))
    assert [step for step, _ in logged(mlflow_client(tmp_path), logger.run_id, "val_loss")] == [0, 1, 2]
    assert len(model.history.history["val_loss"]) == 3


@NEEDS_WANDB
def test_wandb_offline_logs_the_same_content_and_a_resume_continues_the_run(tmp_path):
    pattern = str(tmp_path / "epoch{epoch}.pt")
    first = WandbLogger(project="tiny", save_dir=tmp_path, mode="offline", log_every_n_steps=2)
    fit([first, ModelCheckpoint(pattern, monitor="loss")], epochs=2)
    resumed = WandbLogger(project="tiny", save_dir=tmp_path, mode="offline", log_every_n_steps=2)
    model = fit([resumed], epochs=4, resume_from=pattern.format(epoch=2))
    run = logged_run(tmp_path, epochs=4)
    assert run["ids"] == {first.run_id} == {resumed.run_id}
    epochs = [row for row in run["history"] if "loss" in row]
    assert [row["epoch"] for row in epochs] == [0, 1, 2, 3]
    for key in ("loss", "accuracy", "val_loss", "val_accuracy"):
        assert [row[key] for row in epochs] == pytest.approx(model.history.history[key])
    assert [row["batch_step"] for row in run["history"] if "batch_loss" in row] == [2, 4, 6, 8, 10, 12, 14, 16]
    assert run["config"]["optimizer"] == "sgd" and run["config"]["effective_batch_size"] == 32
    assert run["summary"]["summary"].startswith("effective batch 32")


def test_bad_arguments_are_named_before_training():
    pytest.importorskip("mlflow")
    with pytest.raises(ValueError, match="log_every_n_steps"):
        MLflowLogger(log_every_n_steps=0)
    pytest.importorskip("wandb")
    with pytest.raises(ValueError, match="mode must be"):
        WandbLogger(mode="cloud")


@NEEDS_MLFLOW
@NEEDS_WANDB
@pytest.mark.timeout(600)
def test_ddp_logs_once_from_rank_zero(ddp_around):
    """One run per library, written by rank 0 alone, with the History every rank ends with."""
    from mlflow.tracking import MlflowClient
    out = ddp_around["out"]
    rank0, rank1 = ddp_around["tracking"]
    assert rank1["run_ids"] == [None, None]
    client = MlflowClient(tracking_uri=f"sqlite:///{out}/mlflow.db")
    runs = client.search_runs([client.get_experiment_by_name("around").experiment_id])
    assert [run.info.run_id for run in runs] == [rank0["run_ids"][0]]
    assert runs[0].data.params["world_size"] == "2" and runs[0].data.params["effective_batch_size"] == "32"
    assert logged(client, rank0["run_ids"][0], "val_loss") == [(epoch, pytest.approx(value)) for epoch, value
                                                              in enumerate(rank0["history"]["val_loss"])]
    run = logged_run(out, epochs=3)
    assert run["ids"] == {rank0["run_ids"][1]}
    assert [row["loss"] for row in run["history"] if "loss" in row] == pytest.approx(rank1["history"]["loss"])


@NEEDS_MLFLOW
@NEEDS_WANDB
@pytest.mark.timeout(600)
def test_an_automatic_restart_continues_the_same_runs_and_the_average(tmp_path):
    """ddp on 2 processes with max_restarts=1; rank 1 fails in epoch 2 of the first attempt after rank 0 logged
    batch values of that epoch. Both runs hold each epoch and each step once; EMA continues exactly."""
    from mlflow.tracking import MlflowClient
    results = run_around(tmp_path, "ddp", ["restart"])
    assert "restarting every rank (restart 1 of 1)" in results["stderr"]
    outcome = results["restart"][0]
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path}/mlflow.db")
    run_id = outcome["run_ids"][0]
    assert len(client.search_runs([client.get_experiment_by_name("around").experiment_id])) == 1
    assert logged(client, run_id, "loss") == [(epoch, pytest.approx(value)) for epoch, value
                                              in enumerate(outcome["history"]["loss"])]
    assert [step for step, _ in logged(client, run_id, "batch_loss")] == [2, 4, 6, 8, 10, 12]
    run = logged_run(tmp_path, epochs=3)
    assert run["ids"] == {outcome["run_ids"][1]} and len(offline_runs(tmp_path)) == 2
    assert [row["epoch"] for row in run["history"] if "loss" in row] == [0, 1, 2]
    assert max_difference(outcome["averaged"], hand_ema(3, 0.9)[0]) <= 1e-6
