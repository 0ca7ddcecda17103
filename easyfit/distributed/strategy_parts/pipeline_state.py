"""The whole net's state from a pipeline's stages, and each stage's part of a whole state: module state dicts keyed
as the plain nn.Sequential's, optimizer state keyed by the index of each parameter in the user's optimizer."""
from __future__ import annotations

from easyfit.utils.tensors import on_cpu


def merge_states(parts: list[dict], order: list[str]) -> dict:
    """One state dict from every stage's, in the whole net's key order."""
    merged = {key: value for part in parts for key, value in part.items()}
    return {key: merged[key] for key in order}


def stage_optimizer_state(state: dict, global_index: list[int]) -> dict:
    """A stage optimizer's state dict, its entries keyed by their parameters' indices in the user's optimizer."""
    return {"state": {global_index[local]: on_cpu(entry) for local, entry in state["state"].items()},
            "groups": [{key: value for key, value in group.items() if key != "params"}
                       for group in state["param_groups"]]}


def full_optimizer_state(parts: list[dict], user_groups: list[dict]) -> dict:
    """The user's optimizer's state dict from every stage's part (the hyper-parameters, the same on every stage,
    taken from the first)."""
    entries = {index: entry for part in parts for index, entry in part["state"].items()}
    groups = [dict(user, **hyper) for user, hyper in zip(user_groups, parts[0]["groups"])]
    return {"state": dict(sorted(entries.items())), "param_groups": groups}


def stage_part(state: dict, global_index: list[int]) -> dict:
    """Of a whole optimizer state dict, what the stage optimizer over `global_index` loads."""
    local = {index: position for position, index in enumerate(global_index)}
    groups = [dict(group, params=[local[index] for index in group["params"] if index in local])
              for group in state["param_groups"]]
    entries = {local[index]: entry for index, entry in state["state"].items() if index in local}
    return {"state": entries, "param_groups": groups}


