"""An elastic fit on Ray (`launcher=Ray(num_workers=(min, max))`): Ray Train starts the worker group as soon as `min`
workers can be placed, takes up to `max`, and restarts it on another number of workers when a node is lost or added;
every new group continues from easyfit's fault-tolerance checkpoint in the run's storage path, on the new world
(easyfit.distributed.fault_tolerance: the data re-sharded by its global order, the LR re-scaled).

Here: what an elastic call must satisfy, checked before Ray starts, and the settings it runs with. Only
`check_elastic_ray` imports Ray."""
from __future__ import annotations

from easyfit.distributed.launcher_choice import RAY_INSTALL, Ray

#: an elastic fit's fault-tolerance checkpoint is written every this many optimizer steps (and at every epoch end)
#: unless `fault_tolerance_every_n_steps` says otherwise: a resize trains again at most these steps
ELASTIC_EVERY_N_STEPS = 50
#: the worker groups an elastic fit may lose (a node gone, a worker killed) when `max_restarts` gives no number
ELASTIC_MAX_RESTARTS = 5
#: the strategies whose checkpoint a group of another size loads: the whole net and optimizer state on every worker
#: (ddp; "auto", which is ddp on several workers and one process on one), the optimizer state consolidated on saving
#: and partitioned again on loading (zero, ddp_sharded), or re-sharded on loading (fsdp, its whole checkpoint or its
#: sharded one)
RESIZABLE = ("auto", "ddp", "fsdp", "fsdp_cpu_offload", "zero", "ddp_sharded")
#: why the others cannot continue on another number of workers
CANNOT_RESIZE = {
    "single": "it trains in one process, and an elastic fit's workers are one process group of a varying size",
    "tp": "tensor parallelism splits every layer over exactly the workers it started with",
    "fsdp_tp": "its tensor-parallel groups are pairs of workers, which an odd number of workers cannot form",
    "pipeline": "its stages are the workers: another number of workers is another split of the net, and the stages' "
                "optimizer states would not follow",
    "deepspeed": "a DeepSpeed ZeRO checkpoint holds one optimizer partition per worker, which only as many workers "
                 "load",
}


def check_elastic_workers(options: Ray, devices: int, num_nodes: int) -> None:
    """Refuse devices / num_nodes that fix the number of workers an elastic fit leaves to the cluster."""
    if devices * num_nodes != 1:
        low, high = options.num_workers
        raise ValueError(f"devices={devices} × num_nodes={num_nodes} asks for {devices * num_nodes} workers, but "
                         f"launcher=Ray(num_workers=({low}, {high})) takes between {low} and {high}, as many as the "
                         "cluster can place: leave devices and num_nodes out of an elastic fit (or give "
                         f"Ray(num_workers={devices * num_nodes}) for a fixed number)")


def check_elastic_strategy(strategy) -> None:
    """Refuse a strategy whose fit cannot continue on another number of workers, saying why."""
    name = str(strategy or "auto").lower() if strategy is None or isinstance(strategy, str) else strategy.name
    if name in RESIZABLE:
        return
    reason = CANNOT_RESIZE.get(name.split("_stage")[0], "it is not one that easyfit resizes")
    raise ValueError(f"strategy={name!r} cannot change its number of workers mid-fit, which an elastic fit "
                     f"(launcher=Ray(num_workers=(min, max))) does on every resize: {reason}. Use strategy='ddp', "
                     "'fsdp', 'zero' or 'ddp_sharded' for an elastic fit, or a fixed Ray(num_workers=N) with this "
                     "strategy.")


def elastic_fit_options(options, max_restarts: int):
    """The fit's options in an elastic run: fault tolerance on (its checkpoint is what a resized group continues
    from), written every ELASTIC_EVERY_N_STEPS steps unless given, and the restarts Ray's failure budget allows."""
    if options.fault_tolerance is False:
        raise ValueError("fault_tolerance=False turns off the checkpoint that an elastic fit's resized worker group "
                         "continues from: leave fault_tolerance out (or give a folder every node sees), or give "
                         "a fixed Ray(num_workers=N)")
    every = options.fault_tolerance_every_n_steps or ELASTIC_EVERY_N_STEPS
    return options.replace(fault_tolerance_every_n_steps=every, max_restarts=max_restarts)


def elastic_restarts(max_restarts: int) -> int:
    """The worker groups an elastic fit may lose: the fit's `max_restarts`, else ELASTIC_MAX_RESTARTS."""
    return max_restarts or ELASTIC_MAX_RESTARTS


def check_elastic_data(ray_dataset: bool) -> None:
    """Refuse a `ray.data.Dataset` to train on: Ray Data streams it in its own order, which a resized group cannot
    continue where the last one stopped."""
    if ray_dataset:
        raise ValueError("an elastic fit continues each interrupted epoch at the same place of its global sample "
                         "order, which a ray.data.Dataset streamed by Ray Data does not have: pass arrays, "
                         "tensors or a torch Dataset (e.g. the dataset's columns read into arrays), "
                         "or give a fixed Ray(num_workers=N)")


def check_elastic_ray() -> None:
    """Refuse an elastic fit on a Ray Train without elastic worker groups."""
    import ray
    from ray.train import ScalingConfig
    if not hasattr(ScalingConfig, "elasticity_enabled"):
        raise ImportError(f"an elastic fit needs Ray Train's elastic worker groups (ScalingConfig(num_workers=(min, "
                          f"max))), which Ray {ray.__version__} does not have: upgrade Ray ({RAY_INSTALL} -U), or "
                          "give a fixed Ray(num_workers=N)")
