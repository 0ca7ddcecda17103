"""Optimizers by name, instance or factory; an instance must optimize the net's own parameters."""
from __future__ import annotations

import inspect
from typing import Callable

import torch
from torch import nn

from easyfit.utils.checks import closest_name

#: name -> (optimizer class, default learning rate)
OPTIMIZERS: dict[str, tuple[type, float]] = {
    "adam": (torch.optim.Adam, 1e-3),
    "adamw": (torch.optim.AdamW, 1e-3),
    "sgd": (torch.optim.SGD, 1e-2),
    "rmsprop": (torch.optim.RMSprop, 1e-3),
    "adagrad": (torch.optim.Adagrad, 1e-2),
    "adadelta": (torch.optim.Adadelta, 1.0),
    "adamax": (torch.optim.Adamax, 2e-3),
    "nadam": (torch.optim.NAdam, 2e-3),
    "radam": (torch.optim.RAdam, 1e-3),
}


def optimizer_factory(optimizer, lr: float | None = None,
                      options: dict | None = None) -> Callable[[list], torch.optim.Optimizer]:
    """A function `params -> Optimizer` from a name (with its `options`: momentum=, weight_decay=, betas=, ...) or a
    factory."""
    options = options or {}
    if isinstance(optimizer, str):
        key = optimizer.lower()
        if key not in OPTIMIZERS:
            raise ValueError(f"unknown optimizer {optimizer!r}.{closest_name(key, OPTIMIZERS)} "
                             f"Valid names: {', '.join(sorted(OPTIMIZERS))}; or pass an optimizer instance "
                             "or a factory params -> Optimizer.")
        cls, default_lr = OPTIMIZERS[key]
        check_optimizer_options(cls, options, ("lr", "scheduler", "scheduler_interval", "loss", "metrics"))
        return lambda params: cls(params, lr=default_lr if lr is None else lr, **options)
    if options:
        raise ValueError(f"the optimizer option(s) {', '.join(sorted(options))} apply only to an optimizer given by "
                         f"name (e.g. optimizer='sgd', momentum=0.9); this one ({type(optimizer).__name__}) is built "
                         "already: set them where it is built.")
    if callable(optimizer) and not isinstance(optimizer, torch.optim.Optimizer):
        return optimizer
    raise TypeError(f"optimizer must be a name, a torch.optim.Optimizer or a factory params -> Optimizer; "
                    f"got {type(optimizer).__name__}")


def check_optimizer_options(cls: type, options: dict, others: tuple[str, ...] = ()) -> None:
    """Refuse an option the optimizer class does not take, naming the closest one it does (or one of `others`, the
    caller's own keywords, for a misspelt one of those)."""
    taken = [name for name in inspect.signature(cls.__init__).parameters if name not in ("self", "params", "lr")]
    for name in options:
        if name not in taken:
            raise TypeError(f"{cls.__name__} takes no option {name!r}.{closest_name(name, [*taken, *others])} "
                            f"Its options: {', '.join(taken)}.")


def build_optimizer(optimizer, net: nn.Module, lr: float | None = None,
                    options: dict | None = None) -> torch.optim.Optimizer:
    """The optimizer for `net`: an instance is checked, a name (with its `options`) or a factory is called on
    net.parameters()."""
    if isinstance(optimizer, torch.optim.Optimizer) and not options:
        check_optimizer_owns(optimizer, net)
        return optimizer
    built = optimizer_factory(optimizer, lr, options)(net.parameters())
    if not isinstance(built, torch.optim.Optimizer):
        raise TypeError(f"the optimizer factory returned {type(built).__name__}, not a torch.optim.Optimizer")
    check_optimizer_owns(built, net)
    return built


def check_optimizer_owns(optimizer: torch.optim.Optimizer, net: nn.Module) -> None:
    """Raise if the optimizer updates parameters that are not the net's (e.g. built over another net)."""
    own = {id(p) for p in net.parameters()}
    foreign = sum(1 for group in optimizer.param_groups for p in group["params"] if id(p) not in own)
    if foreign:
        raise ValueError(f"the optimizer holds {foreign} parameter tensor(s) that do not belong to the net passed "
                         "to easyfit.Model, so training would not change the net. Build it over this net: "
                         "e.g. torch.optim.Adam(net.parameters()), or pass a name such as 'adam'.")


def parameter_groups(optimizer: torch.optim.Optimizer, net: nn.Module) -> list[list[int]] | None:
    """The positions in net.parameters() that each parameter group holds, when there are several (else None)."""
    if len(optimizer.param_groups) == 1:
        return None
    position = {id(p): i for i, p in enumerate(net.parameters())}
    return [[position[id(p)] for p in group["params"]] for group in optimizer.param_groups]


def grouped_parameters(net: nn.Module, groups: list[list[int]]) -> list[dict]:
    """net's parameters in the groups `parameter_groups` described (their settings come with the loaded state)."""
    params = list(net.parameters())
    return [{"params": [params[i] for i in group]} for group in groups]


def optimizer_name(optimizer: torch.optim.Optimizer) -> str | None:
    """The name under which easyfit builds this optimizer's class (to rebuild it from a checkpoint), or None."""
    return next((name for name, (cls, _) in OPTIMIZERS.items() if type(optimizer) is cls), None)


def align_state(optimizer: torch.optim.Optimizer) -> None:
    """Cast the optimizer's state (e.g. Adam's moments) to its parameters' current dtype and device, if it differs
    (reloading copies every state tensor, so it is skipped when nothing needs to move)."""
    misplaced = any(isinstance(value, torch.Tensor) and value.dim() > 0
                    and (value.device != param.device or value.dtype != param.dtype)
                    for param, state in optimizer.state.items() for value in state.values())
    if misplaced:
        optimizer.load_state_dict(optimizer.state_dict())


def build_scheduler(scheduler, optimizer):
    """The Model's scheduler: None, a scheduler over `optimizer`, or one a factory builds over it."""
    if scheduler is None:
        return None
    if callable(scheduler) and not hasattr(scheduler, "step"):
        scheduler = scheduler(optimizer)
    if getattr(scheduler, "optimizer", None) is not optimizer:
        raise ValueError("the scheduler must be built over the model's optimizer; pass a factory instead, "
                         "e.g. scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=10)")
    return scheduler
