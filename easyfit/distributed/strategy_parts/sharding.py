"""What the memory-sharded strategies share: the copy of the user's net they train (the user's net waits on the
host meanwhile), the user's optimizer rebuilt over new parameters, the scheduler moved onto it, optional packages
imported on demand, and the bytes each rank holds."""
from __future__ import annotations

import copy
import importlib
import inspect
from collections.abc import Callable
from types import ModuleType

import torch

from easyfit.parts.optimizers import align_state


def require(module: str, extra: str, strategy: str) -> ModuleType:
    """Import an optional package, or say which pip extra installs it."""
    try:
        return importlib.import_module(module)
    except ImportError as error:
        raise ImportError(f"strategy {strategy!r} needs the {module.split('.')[0]} package, which is not installed: "
                          f"pip install easyfit[{extra}]") from error


HOST = torch.device("cpu")


def copy_to_train(net: torch.nn.Module, optimizer: torch.optim.Optimizer, device: torch.device) -> torch.nn.Module:
    """A copy of `net` on `device`, for a backend that takes the module apart (flattens, shards or partitions its
    parameters). `net` and `optimizer`'s state (a resumed or second fit's) wait on the host until the fit hands the
    trained weights and state back, so the device holds one set of them, not two."""
    net.to(HOST)
    align_state(optimizer)
    return copy.deepcopy(net).to(device)


def plain_on_device(user_net: torch.nn.Module, full_state: dict, device: torch.device) -> torch.nn.Module:
    """A plain copy of the (host) user's net holding `full_state`, on `device`: the net of one validation pass,
    freed after it, so that the training steps never share the device with a second full set of weights."""
    net = copy.deepcopy(user_net)
    net.load_state_dict(full_state)
    return net.to(device)


def load_on_device(user_net: torch.nn.Module, full_state: dict, device: torch.device) -> None:
    """The trained weights into the user's net, on the device it trained on (as every strategy leaves it)."""
    user_net.to(device)
    user_net.load_state_dict(full_state)


def constructor_defaults(cls: type, defaults: dict) -> dict:
    """The optimizer's defaults that its class's constructor accepts as keyword arguments."""
    parameters = inspect.signature(cls.__init__).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return dict(defaults)
    return {key: value for key, value in defaults.items() if key in parameters}


def regrouped(optimizer: torch.optim.Optimizer, new_param: Callable[[torch.Tensor], torch.Tensor]) -> list[dict]:
    """The optimizer's param groups (every hyper-parameter kept, in order) over `new_param(p)` for each p."""
    return [dict(group, params=[new_param(p) for p in group["params"]]) for group in optimizer.param_groups]


def rebuild_optimizer(optimizer: torch.optim.Optimizer, new_param: Callable[[torch.Tensor], torch.Tensor],
                      sharding: Callable | None = None) -> torch.optim.Optimizer:
    """An optimizer of the user's class, hyper-parameters and param groups, over new parameters (no state); with
    `sharding(groups, cls, **defaults)` (ZeroRedundancyOptimizer, FairScale's OSS), that optimizer around the class."""
    cls = type(optimizer)
    groups, defaults = regrouped(optimizer, new_param), constructor_defaults(cls, optimizer.defaults)
    try:
        rebuilt = cls(groups, **defaults) if sharding is None else sharding(groups, cls, **defaults)
    except TypeError as error:
        raise TypeError(f"could not rebuild the optimizer {cls.__name__} over the sharded parameters ({error}); "
                        "pass Model an optimizer factory params -> Optimizer instead") from error
    if sharding is None:
        rebuilt.defaults = dict(optimizer.defaults)
    return rebuilt


def move_scheduler(scheduler, optimizer) -> None:
    """Point an LR scheduler (and those it chains) at another optimizer with the same param groups."""
    if scheduler is None:
        return
    scheduler.optimizer = optimizer
    for inner in getattr(scheduler, "_schedulers", ()):
        move_scheduler(inner, optimizer)


def optimizer_params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Every parameter the optimizer holds, in its order (group by group)."""
    return [p for group in optimizer.param_groups for p in group["params"]]


def param_names(net: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """The net's name for every parameter the optimizer holds, in the optimizer's order."""
    names = {id(p): name for name, p in net.named_parameters()}
    return [names[id(p)] for p in optimizer_params(optimizer)]


def without_weights(state: dict) -> dict:
    """A checkpoint state less the net and optimizer, which a sharded format writes in its own files."""
    return {key: value for key, value in state.items() if key not in ("net", "optimizer")}


def directory_outside_fit(path: str, kind: str, resume_under: str) -> ValueError:
    """The error for a sharded checkpoint directory read where no sharded fit can take it."""
    return ValueError(f"{path!r} is a {kind} checkpoint directory: resume it with fit(resume_from=...) under "
                      f"{resume_under}, or turn it into one file: python -m easyfit.checkpoint_convert {path} "
                      "checkpoint.pt")


def local_bytes(tensors) -> int:
    """Bytes of the tensors this rank holds: the local slice of a DTensor, the partition of a ZeRO-3 parameter."""
    total = 0
    for tensor in tensors:
        if not isinstance(tensor, torch.Tensor):
            continue
        local = getattr(tensor, "ds_tensor", None)
        if local is None:
            local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        total += local.numel() * local.element_size()
    return total


def stepping_optimizer(optimizer) -> torch.optim.Optimizer:
    """The optimizer inside the wrappers (ZeRO, OSS, DeepSpeed) that holds the state and steps."""
    while True:
        inner = getattr(optimizer, "optim", None) or getattr(optimizer, "optimizer", None)
        if not isinstance(inner, torch.optim.Optimizer):
            return optimizer
        optimizer = inner


def rank_memory(net: torch.nn.Module, optimizer) -> dict[str, int]:
    """Bytes of parameters and of optimizer state (e.g. Adam's moments) that this rank holds."""
    state = stepping_optimizer(optimizer).state
    return {"parameters": local_bytes(net.parameters()),
            "optimizer_state": local_bytes(v for entry in state.values() for v in entry.values())}
