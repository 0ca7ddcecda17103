"""MLflowLogger: the fit's settings, per-epoch values and checkpoints in an MLflow run, through MLflow's client.

Needs mlflow (pip install easyfit[mlflow]); it is imported only when the fit starts. What is logged, and how a
resumed fit continues its run: easyfit.callbacks.tracking."""
from __future__ import annotations

import importlib.util
import os
import time

from easyfit.callbacks.tracking import TrackingLogger


class MLflowLogger(TrackingLogger):
    """Log to an MLflow run from global rank 0: params (the fit's settings), metrics (every History value per epoch,
    at the epoch number as step; `batch_loss` per N steps when asked), the summary line as the tag `summary`, and
    ModelCheckpoint's files as artifacts under `checkpoints/` when asked.

    Args:
        experiment: the experiment's name (made when missing); None: MLFLOW_EXPERIMENT_NAME, else MLflow's default.
        run_name: the run's name; None: MLflow picks one.
        tracking_uri: where runs are stored (a database URI, a folder, a server); None: MLflow's default
            (MLFLOW_TRACKING_URI, else its local store): nothing to start.
        log_every_n_steps: also log `batch_loss` every this many training batches (None: epochs only).
        log_checkpoints: upload the checkpoints ModelCheckpoint writes as artifacts.

    `run_id` names the run once the fit started; a fit resumed from a checkpoint continues it.
    """

    def __init__(self, experiment: str | None = None, run_name: str | None = None, tracking_uri: str | None = None,
                 log_every_n_steps: int | None = None, log_checkpoints: bool = False):
        if importlib.util.find_spec("mlflow") is None:
            raise ImportError("MLflowLogger needs the mlflow package: pip install easyfit[mlflow]")
        super().__init__(log_every_n_steps, log_checkpoints)
        self.experiment, self.run_name = experiment, run_name
        self.tracking_uri = None if tracking_uri is None else os.fspath(tracking_uri)
        self.client = None

    def _open(self, run_id: str | None) -> str:
        from mlflow.tracking import MlflowClient
        self.client = MlflowClient(tracking_uri=self.tracking_uri)
        if run_id is not None:
            self.client.update_run(run_id, status="RUNNING")
            return run_id
        return self.client.create_run(self._experiment_id(), run_name=self.run_name).info.run_id

    def _experiment_id(self) -> str:
        name = self.experiment or os.environ.get("MLFLOW_EXPERIMENT_NAME")
        if name is None:
            return "0"   # MLflow's Default experiment
        found = self.client.get_experiment_by_name(name)
        return found.experiment_id if found is not None else self.client.create_experiment(name)

    def _log_params(self, params: dict) -> None:
        from mlflow.entities import Param
        self.client.log_batch(self.run_id, params=[Param(key, str(value)) for key, value in params.items()])

    def _log_metrics(self, values: dict, step: int, step_key: str) -> None:
        from mlflow.entities import Metric
        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(key, float(value), now, step)
                                                    for key, value in values.items()])

    def _set_tag(self, key: str, value: str) -> None:
        self.client.set_tag(self.run_id, key, value)

    def _log_checkpoint(self, path: str) -> None:
        if os.path.isdir(path):   # a sharded checkpoint's folder
            self.client.log_artifacts(self.run_id, path, f"checkpoints/{os.path.basename(path)}")
        else:
            self.client.log_artifact(self.run_id, path, "checkpoints")

    def _close(self) -> None:
        self.client.set_terminated(self.run_id, "FINISHED")
        self.client = None

    def _held_by_run(self) -> tuple[int, int]:
        epochs = self.client.get_metric_history(self.run_id, "epoch")
        steps = self.client.get_metric_history(self.run_id, "batch_loss")
        return (max((int(m.step) for m in epochs), default=-1) + 1, max((int(m.step) for m in steps), default=0))
