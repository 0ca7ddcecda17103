"""The metrics' accumulated state in a mid-epoch checkpoint, and putting it back, so that a resumed epoch's metrics
cover every batch of the epoch, those before the checkpoint included.

Each rank's own, unsynchronised metric state is kept (the epoch's values are synchronised only when the epoch
ends), as checkpoint data: tensors, numbers, strings, lists and dicts. On the same number of processes every rank
gets its own state back: exact. On another number, the ranks' states are merged into the new rank 0's where every
state of the metric is reduced by sum, cat, max or min (all of easyfit's named metrics): exact too; a metric reduced
otherwise (a mean, a custom reduction) starts again at the resume, and `restore` names it.
"""
from __future__ import annotations

import io

import torch

from easyfit.parts.metrics import MetricSet, Task
from easyfit.utils.tensors import on_cpu


def gather(metrics: MetricSet, strategy) -> list[dict]:
    """Every rank's state, in rank order (one collective of bytes on `strategy.root_device`; every rank calls it)."""
    mine = rank_state(metrics)
    if strategy.world_size == 1:
        return [mine]
    buffer = io.BytesIO()
    torch.save(mine, buffer)
    data = torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8).to(strategy.root_device)
    return [torch.load(io.BytesIO(part.cpu().numpy().tobytes()), weights_only=True)
            for part in strategy.all_gather(data)]


def rank_state(metrics: MetricSet) -> dict:
    """This rank's state: the task its named metrics were built for, and each metric's states and update count."""
    metrics.flush()
    task = metrics.task
    return {"task": None if task is None else list(task),
            "metrics": {name: {"updates": int(metric._update_count),
                               "states": {key: on_cpu(value) for key, value in metric.metric_state.items()}}
                        for name, metric in metrics.metrics.items() if _has_state(metric)}}


def restore(metrics: MetricSet, ranks: list[dict], rank: int, world_size: int, device) -> list[str]:
    """Reset the metrics, then give this rank its saved state (`ranks`: what `gather` returned when the checkpoint
    was written). Returns the names of the metrics that could not be restored exactly on this world size."""
    metrics.reset()
    task = next((saved["task"] for saved in ranks if saved["task"] is not None), None)
    if metrics.pending and task is not None:   # built as they were when the checkpoint was written
        name, classes, outputs, one_hot = task
        metrics._build(Task(name, int(classes), outputs, bool(one_hot)), device)
    stateless = [name for name, metric in metrics.metrics.items() if not _has_state(metric)]
    if len(ranks) == world_size:
        return stateless + [name for name, saved in ranks[rank]["metrics"].items()
                            if name in metrics.metrics and name not in stateless
                            and not _load(metrics.metrics[name], saved)]
    inexact = stateless
    for name, metric in metrics.metrics.items():
        states = [saved["metrics"][name] for saved in ranks if name in saved["metrics"]]
        if not states or not _has_state(metric):
            continue
        merged = _merged(metric, states) if all(_fits(metric, state) for state in states) else None
        if merged is None:
            inexact.append(name)
        elif rank == 0:   # the other ranks start the rest of the epoch with empty states
            _load(metric, merged)
    return inexact


def _merged(metric, states: list[dict]) -> dict | None:
    """One state holding the batches of every rank, or None when a state's reduction cannot merge them exactly."""
    merged = {}
    for key, reduction in metric._reductions.items():
        values = [state["states"][key] for state in states]
        kind = _reduction_kind(reduction)
        if kind == "cat":
            merged[key] = ([tensor for value in values for tensor in value] if isinstance(values[0], list)
                           else torch.cat([value.reshape(-1, *value.shape[1:]) for value in values]))
        elif kind in MERGES:
            merged[key] = MERGES[kind](torch.stack(values))
        else:
            return None
    return {"updates": sum(state["updates"] for state in states), "states": merged}


#: how states reduced by each kind are merged (a "cat" state is joined)
MERGES = {"sum": lambda stacked: stacked.sum(0), "max": lambda stacked: stacked.max(0).values,
          "min": lambda stacked: stacked.min(0).values}


def _reduction_kind(reduction) -> str | None:
    """"sum", "cat", "max" or "min" for easyfit's metrics (which name it) and torchmetrics' reduction functions;
    None for any other reduction."""
    if isinstance(reduction, str):
        return reduction
    module = getattr(reduction, "__module__", "") or ""
    if module.startswith("torchmetrics"):   # torchmetrics is imported already: the metric is one of its objects
        from torchmetrics.utilities import data
        return {data.dim_zero_cat: "cat", data.dim_zero_sum: "sum", data.dim_zero_max: "max",
                data.dim_zero_min: "min"}.get(reduction)
    return None


def _fits(metric, saved: dict) -> bool:
    """Whether a saved state is one of this metric's (a checkpoint of another easyfit version may hold another
    metric object's states under the same name)."""
    return set(saved["states"]) == set(metric.metric_state)


def _load(metric, saved: dict) -> bool:
    """Put a saved state into the metric; False when it is not one of this metric's."""
    if not _has_state(metric) or not _fits(metric, saved):
        return False
    device = metric.device
    for key, value in saved["states"].items():
        setattr(metric, key, [tensor.to(device) for tensor in value] if isinstance(value, list) else value.to(device))
    metric._update_count = saved["updates"]
    metric._computed = None
    return True


def _has_state(metric) -> bool:
    """A metric whose states can be read and set (easyfit's named metrics, a torchmetrics Metric); a duck-typed
    metric's state is its own."""
    return hasattr(metric, "metric_state") and hasattr(metric, "_reductions")
