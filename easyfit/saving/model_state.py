"""A Model's whole training state as one checkpoint dict, loading it back (to resume exactly), keeping it to put
back after a call (`Snapshot`), and the Model arguments a saved checkpoint names."""
from __future__ import annotations

import contextlib
import copy
import os

import torch

from easyfit.parts.lr_scaling import rescale_learning_rates
from easyfit.parts.optimizers import grouped_parameters, optimizer_factory
from easyfit.saving.resume import EpochPosition
from easyfit.utils.tensors import on_cpu

#: the objects a call gives the Model anew (a fit's History; what the call leaves: its callbacks, precision plugin)
CALL_OBJECTS = ("history", "_last_call")


def checkpoint_state(model) -> dict:
    """Everything needed to resume training exactly."""
    fit = model._state_owner()
    return {
        "spec": model.spec,
        "net": fit.module_state(),
        "optimizer": fit.optimizer_state(),
        "scheduler": fit.scheduler.state_dict() if fit.scheduler is not None else None,
        "scaler": model.precision.state_dict(),
        "epoch": model.completed_epochs,
        "position": model.position.state_dict(fit.strategy, model.metrics),
        "lr_multiplier": model._lr_multiplier,   # the scale the fit's steps took (the optimizer holds the rates
        "unscaled_lrs": True,                    # before it; older checkpoints held them scaled)
        "history": model.history.state_dict(),
        "callbacks": model._callbacks.state_dict(),
        **random_states(model.strategy),
    }


def random_states(strategy) -> dict:
    """The random states a checkpoint holds, as tensors and numbers: torch's CPU generator, CUDA's once in use, and
    the device generator of the strategy that trains, or last trained, in this process (XLA's: dropout on the
    device). The same for every writer: ModelCheckpoint and the fault-tolerance checkpoint inside fit, model.save
    after it."""
    return {"rng": torch.get_rng_state(),
            "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None,
            **strategy.device_rng_state()}


def restore(model, state: dict, training: bool = False) -> None:
    """Load a checkpoint state; with `training`, also the RNG, scaler and callback states (for resuming)."""
    fit = model._state_owner(loading=True)
    fit.load_module_state(state["net"])
    fit.load_optimizer_state(state["optimizer"])
    if fit.scheduler is not None and state.get("scheduler") is not None:
        fit.scheduler.load_state_dict(state["scheduler"])
    if not state.get("unscaled_lrs"):   # written by an older easyfit, whose optimizer held the scaled rates
        rescale_learning_rates(fit.optimizer, fit.scheduler, 1.0 / state.get("lr_multiplier", 1.0))
    model.completed_epochs = state["epoch"]
    model.history.load_state_dict(state["history"])
    if training:
        model.precision.load_state_dict(state["scaler"])
        model._callbacks.load_state_dict(state["callbacks"])
        model.position = EpochPosition.from_state(state.get("position"), model.strategy, model.metrics)
        restore_random_states(model, state)


def restore_random_states(model, state: dict) -> None:
    """torch's CPU and CUDA generators and the strategy's device generator, as `state` (`random_states`) holds them."""
    torch.set_rng_state(state["rng"].cpu())
    if state.get("cuda_rng") is not None and torch.cuda.is_available():
        for index, device_state in enumerate(state["cuda_rng"][:torch.cuda.device_count()]):
            torch.cuda.set_rng_state(device_state.cpu(), index)
    model.strategy.load_device_rng_state(state)


class Snapshot:
    """A Model's objects `names` as they are, and with `training_state` a copy (on the CPU) of its whole training
    state (weights, optimizer, scheduler, scaler, History, epoch, callbacks, random generators): the one way a call
    keeps a Model's state to put it back (trial fits, restart attempts, the single-batch calls)."""

    def __init__(self, model, names: tuple = CALL_OBJECTS, training_state: bool = False):
        self.model, self.objects = model, {name: getattr(model, name) for name in names}
        self.state = copy.deepcopy(on_cpu(checkpoint_state(model))) if training_state else None

    def put_back(self, again: bool = False) -> None:
        """The kept objects, then the training state, back in the Model (`again`: from a copy, to put back later
        once more)."""
        for name, value in self.objects.items():
            setattr(self.model, name, value)
        if self.state is not None:
            restore(self.model, copy.deepcopy(self.state) if again else self.state, training=True)
            self.model.stop_training = False


@contextlib.contextmanager
def kept(model, names: tuple = CALL_OBJECTS, training_state: bool = False):
    """Inside the block the Model may change; after it (even when it raised) its kept state is back (`Snapshot`)."""
    snapshot = Snapshot(model, names, training_state)
    try:
        yield snapshot
    finally:
        snapshot.put_back()


def saved_arguments(state: dict, path, net, loss, optimizer, metrics, keywords: dict) -> tuple[tuple, dict]:
    """(loss, optimizer, metrics), Model's keyword arguments: those given, else those the checkpoint names."""
    spec = state.get("spec", {})
    if loss is None and spec.get("loss") is None:
        raise ValueError(f"{os.fspath(path)!r} was saved with a loss easyfit has no name for (an object or a "
                         "function); pass the same loss to Model.load(..., loss=...)")
    if optimizer is None and spec.get("optimizer") is None:
        raise ValueError(f"{os.fspath(path)!r} was saved with an optimizer easyfit has no name for; "
                         "pass the same kind to Model.load(..., optimizer=...) to restore its state")
    if optimizer is None and spec.get("param_groups"):   # rebuilt in the saved groups; their settings load next
        optimizer = optimizer_factory(spec["optimizer"])(grouped_parameters(net, spec["param_groups"]))
    lr = keywords.pop("lr", spec.get("lr") if optimizer is None else None)
    options = spec.get("optimizer_options") or {} if optimizer is None else {}   # momentum=, ... of a name
    arguments = (loss if loss is not None else spec["loss"], optimizer if optimizer is not None else spec["optimizer"],
                 metrics if metrics is not None else spec.get("metrics"))
    return arguments, {"lr": lr, **options, **keywords}
