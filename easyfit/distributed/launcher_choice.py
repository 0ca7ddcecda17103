"""The values of the `launcher=` run option (who starts the ranks of a call), public through `easyfit.launchers`:
"auto" (easyfit's own choice: the script re-run, spawn / fork, or the launcher that started this process), "ray",
or `Ray(...)` with Ray Train's options. Nothing here imports Ray."""
from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from typing import Any

#: the strategies Ray Train cannot host, and why
NOT_ON_RAY = {
    "dp": "DataParallel runs every device in one process, and Ray Train starts one process per worker",
    "horovod": "Horovod makes its own ring with horovodrun / MPI, not the torch.distributed group Ray makes",
    "xla": "torch_xla's TPU processes are started by torch_xla (xmp.spawn / PJRT), not by Ray Train's TorchTrainer",
    "bagua": "Bagua needs its own launcher's service port beside the process group",
    "ddp2": "ddp2 runs several devices in each process, and Ray Train starts one process per worker",
}
#: strategies that start their own processes: under Ray its workers are the processes, so they train as "ddp" does
STARTS_OWN = ("ddp_spawn", "ddp_fork", "ddp_notebook", "ddp_sharded_spawn")
RAY_INSTALL = 'pip install "easyfit[ray]" (or pip install "ray[train]")'


@dataclass(frozen=True)
class Ray:
    """Run the call as a Ray Train `TorchTrainer` (launcher="ray" is `Ray()`): devices × num_nodes workers whose
    process group Ray makes, on the cluster `ray.init` finds (RAY_ADDRESS, `address`) or a local one started for it.

    Args:
        address: the cluster ("auto", "host:port", "ray://host:10001"); None: RAY_ADDRESS, else a running cluster
            this process joined, else a new local one. Once this process joined a cluster, another's is refused.
        num_workers: workers; None: devices × num_nodes; `(min, max)`: an elastic fit, which starts as soon as `min`
            workers can be placed, takes up to `max`, and continues on every resize from its last checkpoint
            (docs/ray.md "Elastic").
        use_gpu: one GPU per worker; None: as `accelerator` says ("auto": when the cluster has GPUs).
        resources_per_worker: Ray resources of each worker (default {"CPU": 1}, plus {"GPU": 1} with GPUs).
        storage_path: where Ray keeps the run (and easyfit its fault-tolerance checkpoint); None: ~/ray_results.
        runtime_env: Ray's runtime environment of the workers (pip packages, working_dir, env_vars, ...); local
            files (py_modules, working_dir) only where the call joins the cluster: after your own ray.init(), give
            them to it.
        resize_check_s: an elastic fit asks the cluster for more workers every this many seconds (Ray's
            `elastic_resize_monitor_interval_s`); None: Ray's default, 60.
    """
    address: str | None = None
    num_workers: int | tuple[int, int] | None = None
    use_gpu: bool | None = None
    resources_per_worker: dict | None = None
    storage_path: str | None = None
    runtime_env: dict | None = field(default=None, hash=False)
    resize_check_s: float | None = None

    def __post_init__(self):
        if self.elastic:
            _check_elastic(self.num_workers)
            object.__setattr__(self, "num_workers", tuple(self.num_workers))
        elif self.num_workers is not None and not _positive_int(self.num_workers):
            raise ValueError("Ray(num_workers=...) must be a positive integer, a (min, max) pair of them for an "
                             f"elastic fit, or None; got {self.num_workers!r}")
        seconds = self.resize_check_s
        if seconds is not None and not (self.elastic and isinstance(seconds, (int, float)) and seconds >= 0):
            raise ValueError(f"Ray(resize_check_s={self.resize_check_s!r}) is the seconds between an elastic fit's "
                             "checks for more workers: give num_workers=(min, max) and a number >= 0, or leave it out")
        if self.use_gpu not in (None, True, False):
            raise TypeError(f"Ray(use_gpu=...) must be True, False or None, got {self.use_gpu!r}")
        for name in ("resources_per_worker", "runtime_env"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), dict):
                raise TypeError(f"Ray({name}=...) must be a dict or None, got {type(getattr(self, name)).__name__}")

    @property
    def elastic(self) -> bool:
        """Whether the fit resizes with the cluster: num_workers=(min, max)."""
        return isinstance(self.num_workers, (tuple, list))


def _positive_int(value) -> bool:
    return type(value) is int and value > 0


def _check_elastic(num_workers) -> None:
    if len(num_workers) != 2 or not all(map(_positive_int, num_workers)):
        raise ValueError(f"Ray(num_workers={num_workers!r}): an elastic fit takes (min, max), two positive integers")
    low, high = num_workers
    if high < low:
        raise ValueError(f"Ray(num_workers=({low}, {high})): max {high} < min {low}; give (min, max) with min <= max, "
                         f"e.g. ({high}, {low})")


def ray_options(value: Any) -> Ray | None:
    """The Ray options of a `launcher=` value, or None when easyfit's own choice starts the ranks."""
    if isinstance(value, Ray):
        return value
    return Ray() if isinstance(value, str) and value.lower() == "ray" else None


def check_ray_call(method: str, strategy_name: str) -> None:
    """Refuse, before Ray starts, a call that cannot run as a Ray Train run, saying what to change."""
    if method not in ("fit", "evaluate", "predict"):
        raise ValueError(f"launcher='ray' runs fit, evaluate and predict; {method} runs in this process: leave "
                         "launcher out (or call it inside a fit's callback)")
    if strategy_name in NOT_ON_RAY:
        raise ValueError(f"strategy={strategy_name!r} cannot run under launcher='ray': {NOT_ON_RAY[strategy_name]}. "
                         "Use strategy='ddp', 'fsdp', 'deepspeed', 'tp' or 'pipeline' there, or leave launcher out.")
    if strategy_name in STARTS_OWN:
        raise ValueError(f"strategy={strategy_name!r} starts its own processes, but under launcher='ray' Ray's "
                         "workers are the processes: use strategy='ddp' (or 'auto') there.")
    if importlib.util.find_spec("ray") is None or importlib.util.find_spec("ray.train") is None:
        raise ImportError(f"launcher='ray' needs Ray Train, which is not installed: {RAY_INSTALL}")
