"""The callbacks around the fit on 2 CPU processes, as a real program (several checks per launch: starting processes
is what costs time).

Usage: python around.py OUT_DIR STRATEGY[,STRATEGY...] CHECK[,CHECK...]
STRATEGY is a strategy's name, or fsdp_sharded: FSDP(state_dict_type="sharded"); each runs every CHECK, in turn.
CHECK is one of:
  ema         EMA(0.9), SGD, 3 epochs with validation and a checkpoint per epoch; then a resume from epoch 2
  swa         SWA(swa_lr=0.02, start_epoch=1, annealing_epochs=1), SGD, 3 epochs
  optuna      an in-memory study (MedianPruner) of 3 trials whose third is bad; every fit on STRATEGY
  throughput  ThroughputMonitor(peak_flops=1e12), 2 epochs
  profiler    Profiler(wait=1, warmup=1, active=2) writing OUT_DIR/profile
  tracking    MLflowLogger (sqlite under OUT_DIR) and WandbLogger (offline, under OUT_DIR/wandb), 3 epochs
  restart     tracking and EMA in a fit with max_restarts=1 whose rank 1 fails in epoch 2 on the first attempt
Each rank writes OUT_DIR/result-<STRATEGY>-<CHECK>-<rank>.pt with what it measured. With STRATEGY ddp_spawn /
ddp_fork the script runs once (the fits start the ranks) and writes result-<STRATEGY>-<CHECK>-0.pt.
"""
import os
import sys

import torch

import easyfit
from easyfit.callbacks import (
    EMA,
    SWA,
    Callback,
    MLflowLogger,
    ModelCheckpoint,
    OptunaPruning,
    Profiler,
    ThroughputMonitor,
    WandbLogger,
)
from easyfit.distributed.environments import launch_identity
from easyfit.strategies import FSDP

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "distributed", "scripts"))
from common import make_data, make_net

LR, DECAY = 0.1, 0.9


def model_for(lr: float = LR) -> easyfit.Model:
    net = make_net()
    return easyfit.Model(net, "cross_entropy", torch.optim.SGD(net.parameters(), lr=lr))


def fit(model: easyfit.Model, strategy: str, epochs: int, callbacks: list, **options):
    x, y = make_data()
    if strategy == "fsdp_sharded":   # FSDP writing torch.distributed.checkpoint directories
        strategy = FSDP(state_dict_type="sharded")
    batch_size = 32 if strategy == "tp" else 16   # tp's ranks share one batch: the others' two batches together
    return model.fit(x, y, batch_size=batch_size, epochs=epochs, shuffle=False, verbose=0, lr_scaling=None, devices=2,
                     accelerator="cpu", strategy=strategy, validation_data=(x[:64], y[:64]), callbacks=callbacks,
                     **options)


def plain(state: dict) -> dict:
    return {key: value.detach().clone().cpu() for key, value in state.items()}


def ema(strategy: str, out: str) -> dict:
    model, pattern = model_for(), os.path.join(out, f"{strategy}-ema-{{epoch}}.pt")
    history = fit(model, strategy, 3, [EMA(DECAY), ModelCheckpoint(pattern, monitor="loss")])
    resumed = model_for()
    fit(resumed, strategy, 3, [EMA(DECAY)], resume_from=pattern.format(epoch=2))
    return {"averaged": plain(model.net.state_dict()), "history": history.history,
            "checkpoint": pattern.format(epoch=2), "resumed": plain(resumed.net.state_dict())}


def swa(strategy: str, out: str) -> dict:
    model = model_for()
    fit(model, strategy, 3, [SWA(swa_lr=0.02, start_epoch=1, annealing_epochs=1)])
    return {"averaged": plain(model.net.state_dict())}


def optuna_search(strategy: str, out: str) -> dict:
    import optuna
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(pruner=optuna.pruners.MedianPruner(n_startup_trials=2, n_warmup_steps=0))
    for lr in (0.5, 0.5, 1e-6):
        study.enqueue_trial({"lr": lr})
    epochs = {}

    def objective(trial):
        model = model_for(trial.suggest_float("lr", 1e-6, 1.0, log=True))
        try:
            return fit(model, strategy, 4, [OptunaPruning(trial)]).history["val_loss"][-1]
        finally:
            epochs[trial.number] = model.completed_epochs

    study.optimize(objective, n_trials=3)
    return {"trials": [(t.number, t.state.name, dict(t.intermediate_values)) for t in study.trials],
            "epochs": epochs}


def throughput(strategy: str, out: str) -> dict:
    return {"history": fit(model_for(), strategy, 2, [ThroughputMonitor(peak_flops=1e12)]).history}


def profiler(strategy: str, out: str) -> dict:
    callback = Profiler(wait=1, warmup=1, active=2, output=os.path.join(out, "profile"))
    fit(model_for(), strategy, 1, [callback])
    return {"trace": callback.trace, "summary": callback.summary}


def loggers(out: str) -> list:
    return [MLflowLogger(experiment="around", tracking_uri=f"sqlite:///{out}/mlflow.db", log_every_n_steps=2),
            WandbLogger(project="around", save_dir=out, mode="offline")]


def tracking(strategy: str, out: str) -> dict:
    callbacks = loggers(out)
    history = fit(model_for(), strategy, 3, callbacks)
    return {"history": history.history, "run_ids": [callback.run_id for callback in callbacks]}


class FailOnce(Callback):
    """Rank 1 raises in epoch 2, batch 1, on the first attempt only."""

    def __init__(self):
        self.epoch = 0

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if (os.environ.get("EASYFIT_RESTART_COUNT"), self.model.global_rank, self.epoch, batch) == ("0", 1, 1, 1):
            raise RuntimeError("deliberate failure on rank 1 in epoch 2")


def restart(strategy: str, out: str) -> dict:
    callbacks, model = loggers(out), model_for()
    history = fit(model, strategy, 3, [*callbacks, EMA(DECAY), FailOnce()], max_restarts=1,
                  fault_tolerance=os.path.join(out, "fault-tolerance"))
    return {"history": history.history, "run_ids": [callback.run_id for callback in callbacks],
            "averaged": plain(model.net.state_dict())}


CHECKS = {"ema": ema, "swa": swa, "optuna": optuna_search, "throughput": throughput, "profiler": profiler,
          "tracking": tracking, "restart": restart}


def main() -> None:
    out, strategies, checks = sys.argv[1], sys.argv[2].split(","), sys.argv[3].split(",")
    os.environ.update(WANDB_SILENT="true", WANDB_MODE="offline")
    for strategy in strategies:
        for check in checks:
            result = CHECKS[check](strategy, out)
            rank = launch_identity()[0]
            torch.save(result, os.path.join(out, f"result-{strategy}-{check}-{rank}.pt"))


if __name__ == "__main__":
    main()
