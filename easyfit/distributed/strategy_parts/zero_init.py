"""Nets built under DeepSpeed's ZeRO-3 `module_construction()` (`deepspeed.zero.Init`): the engine trains the
user's net itself, partitioned. What it adds to the modules (hooks, attributes, a parameter dict that gathers on
access, partitioned parameters) is undone here, to give a plain module with the full weights: the user's net at
the end of fit, or a copy of it for validation inside fit.
"""
from __future__ import annotations

import copy

import torch

Layout = dict[int, tuple[set[str], dict[str, set]]]


def held_by_engine(net: torch.nn.Module) -> bool:
    """The net is still the module of a DeepSpeed engine (a fit with hand_back=False did not release it)."""
    return any(hasattr(module, "_original_parameters") for module in net.modules())


def _hook_dicts(module: torch.nn.Module) -> dict[str, dict]:
    return {name: value for name, value in vars(module).items() if "hooks" in name and isinstance(value, dict)}


def layout(net: torch.nn.Module) -> Layout:
    """Each module's attribute names and hook keys before the engine is built: what the plain module has."""
    return {id(m): (set(vars(m)), {name: set(hooks) for name, hooks in _hook_dicts(m).items()})
            for m in net.modules()}


def _plain_attributes(module: torch.nn.Module, names: set[str], hook_keys: dict[str, set],
                      fresh: dict[int, torch.nn.Parameter]) -> dict:
    """The module's attributes as a plain module has them: its own hooks only, fresh full parameters."""
    attributes = {name: value for name, value in vars(module).items() if name in names}
    for name, hooks in _hook_dicts(module).items():
        if name in attributes:
            attributes[name] = type(hooks)((key, hook) for key, hook in hooks.items() if key in hook_keys[name])
    attributes["_parameters"] = {name: None if p is None else fresh[id(p)] for name, p in module._parameters.items()}
    return attributes


def fresh_parameters(net: torch.nn.Module, full: dict, device: torch.device) -> dict[int, torch.nn.Parameter]:
    """A plain Parameter with the full weights for each partitioned one (tied parameters stay tied)."""
    fresh: dict[int, torch.nn.Parameter] = {}
    for name, param in net.named_parameters(remove_duplicate=True):
        fresh[id(param)] = torch.nn.Parameter(full[name].to(device), requires_grad=param.requires_grad)
    return fresh


def make_plain(net: torch.nn.Module, saved: Layout, fresh: dict[int, torch.nn.Parameter]) -> None:
    """Turn the engine's partitioned net into a plain module holding the `fresh` parameters, in place."""
    for module in list(net.modules()):
        attributes = _plain_attributes(module, *saved[id(module)], fresh)
        vars(module).clear()
        vars(module).update(attributes)


def plain_copy(net: torch.nn.Module, saved: Layout, full: dict, device: torch.device) -> torch.nn.Module:
    """A plain module with the full weights, built from the partitioned net, which is left as it was."""
    fresh = fresh_parameters(net, full, device)
    originals = {id(m): (m, dict(vars(m))) for m in net.modules()}
    try:
        make_plain(net, saved, fresh)
        return copy.deepcopy(net, memo={id(p): p for p in fresh.values()})
    finally:
        for module, attributes in originals.values():
            vars(module).clear()
            vars(module).update(attributes)


def cast_partitions(net: torch.nn.Module, dtype: torch.dtype) -> None:
    """Each floating parameter's partition (and its empty placeholder) in `dtype`, as the engine casts a net it
    partitions itself."""
    for param in net.parameters():
        if param.is_floating_point() and param.dtype != dtype:
            param.data = param.data.to(dtype)
            param.ds_tensor.data = param.ds_tensor.data.to(dtype)


def repoint_optimizer(optimizer: torch.optim.Optimizer, fresh: dict[int, torch.nn.Parameter]) -> None:
    """The user's optimizer over the fresh parameters that replaced the partitioned ones (its state is reloaded
    after)."""
    optimizer.state.clear()
    for group in optimizer.param_groups:
        group["params"] = [fresh.get(id(p), p) for p in group["params"]]
