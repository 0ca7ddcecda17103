"""WandbLogger: the fit's settings, per-epoch values and checkpoints in a Weights & Biases run.

Needs wandb (pip install easyfit[wandb]); it is imported only when the fit starts. What is logged, and how a
resumed fit continues its run: easyfit.callbacks.tracking."""
from __future__ import annotations

import importlib.util
import os

from easyfit.callbacks.tracking import TrackingLogger

#: the runs this process opened and has not finished, by id: a restarted attempt's callback is put back as it was
#: before the first attempt, so it no longer holds the run its failed attempt left open
OPEN_RUNS: dict = {}


class WandbLogger(TrackingLogger):
    """Log to a W&B run from global rank 0: the config (the fit's settings), every History value per epoch (against
    `epoch`), `batch_loss` per N steps when asked (against `batch_step`), the summary line in the run's summary,
    and ModelCheckpoint's files as `model` artifacts when asked.

    Args:
        project: the W&B project; None: WANDB_PROJECT, else W&B's default.
        name: the run's display name.
        save_dir: the folder W&B writes its run files under (None: WANDB_DIR, else the working directory).
        entity, tags, group: as `wandb.init` takes them.
        mode: "online", "offline" (run files only, `wandb sync` uploads them later) or "disabled"; None: WANDB_MODE,
            else online.
        log_every_n_steps: also log `batch_loss` every this many training batches (None: epochs only).
        log_checkpoints: upload the checkpoints ModelCheckpoint writes as artifacts.

    `run_id` names the run once the fit started; a fit resumed from a checkpoint continues it (resume="allow").
    """

    def __init__(self, project: str | None = None, name: str | None = None, save_dir: str | None = None,
                 entity: str | None = None, tags: list[str] | None = None, group: str | None = None,
                 mode: str | None = None, log_every_n_steps: int | None = None, log_checkpoints: bool = False):
        if importlib.util.find_spec("wandb") is None:
            raise ImportError("WandbLogger needs the wandb package: pip install easyfit[wandb]")
        if mode not in (None, "online", "offline", "disabled"):
            raise ValueError(f"WandbLogger: mode must be 'online', 'offline', 'disabled' or None, got {mode!r}")
        super().__init__(log_every_n_steps, log_checkpoints)
        self.init_arguments = {"project": project, "name": name, "entity": entity, "tags": tags, "group": group,
                               "mode": mode, "dir": None if save_dir is None else os.fspath(save_dir)}
        self.run = None

    def _open(self, run_id: str | None) -> str:
        import wandb
        if run_id in OPEN_RUNS:   # a failed attempt in this process left it open: a restart continues it
            OPEN_RUNS.pop(run_id).finish()
        self.run = wandb.init(**self.init_arguments, id=run_id, resume="allow" if run_id else None,
                              reinit="create_new")
        self.run.define_metric("epoch")
        self.run.define_metric(self.STEP_KEY)
        self.run.define_metric("*", step_metric="epoch")
        self.run.define_metric("batch_loss", step_metric=self.STEP_KEY)
        OPEN_RUNS[self.run.id] = self.run
        return self.run.id

    def _log_params(self, params: dict) -> None:
        self.run.config.update(params, allow_val_change=True)

    def _log_metrics(self, values: dict, step: int, step_key: str) -> None:
        self.run.log({**values, step_key: step})

    def _set_tag(self, key: str, value: str) -> None:
        self.run.summary[key] = value

    def _log_checkpoint(self, path: str) -> None:
        import wandb
        artifact = wandb.Artifact(f"checkpoints-{self.run.id}", type="model")
        if os.path.isdir(path):
            artifact.add_dir(path, name=os.path.basename(path))
        else:
            artifact.add_file(path)
        self.run.log_artifact(artifact)

    def _close(self) -> None:
        OPEN_RUNS.pop(self.run.id, None)
        self.run.finish()
        self.run = None
