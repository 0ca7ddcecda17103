"""`launcher="ray"`: the call runs as a Ray Train `TorchTrainer`, one worker per rank, whose process group Ray
makes; each worker runs easyfit's rank body (easyfit.distributed.launchers.ray_worker) and rank 0 hands its result
and state back through a small actor, as a spawned rank 0 does through a file.

Before Ray starts any worker: the cluster is joined (RAY_ADDRESS / `address`, else the running one, else a new local
one; an address that does not answer is refused within seconds; one that contradicts the cluster this process joined
already, and local files in `runtime_env` that only `ray.init` uploads, are refused), and the workers asked for are
checked against the cluster's CPUs and GPUs. The call's inputs go into Ray's object store once; a `ray.data.Dataset`
is handed to Ray Train, which streams each worker its shard (easyfit.data.ray_dataset)."""
from __future__ import annotations

import os
import socket
import uuid
from typing import Any, Callable

from easyfit.distributed.fault_tolerance import DEFAULT_FOLDER
from easyfit.distributed.launcher_choice import RAY_INSTALL, Ray
from easyfit.distributed.launchers.base import Launcher
from easyfit.distributed.launchers.failures import RankFailedError, root_cause
from easyfit.distributed.launchers.ray_elastic import (
    check_elastic_data,
    check_elastic_ray,
    check_elastic_strategy,
    check_elastic_workers,
    elastic_fit_options,
    elastic_restarts,
)
from easyfit.distributed.launchers.ray_worker import CONFIG_KEYS, mailbox, run_worker

#: how long an address may take to answer before the call is refused
ADDRESS_TIMEOUT_SECONDS = 10.0


class RayLauncher(Launcher):
    """Runs a call's ranks as the workers of one Ray Train run; the caller gets rank 0's result.

    `worker_plan(plan, model, options)`: the call's plan made again in a worker, where Ray's worker context is the
    launch environment (the strategy joins Ray's process group, as under torchrun)."""

    rank_zero_in_caller = False

    def __init__(self, options: Ray, devices: int, num_nodes: int, accelerator: str, max_restarts: int,
                 worker_plan: Callable):
        self.options, self.accelerator, self.max_restarts = options, str(accelerator).lower(), max_restarts
        if options.elastic:   # Ray sizes the group; a lost worker group is a resize, within a budget of its own
            check_elastic_workers(options, devices, num_nodes)
            self.max_restarts = elastic_restarts(max_restarts)
        self.num_workers = options.num_workers or devices * num_nodes
        # several nodes: the workers spread over the cluster's nodes (Ray's "SPREAD"), else packed on the fewest
        self.placement = "SPREAD" if num_nodes > 1 else "PACK"
        self.worker_plan = worker_plan

    def start(self, function: Callable, plan, model=None, **inputs) -> Any:
        if self.options.elastic:
            inputs = self._elastic_inputs(plan, inputs)
        ray = import_ray()
        from ray import cloudpickle
        from ray.train import WorkerGroupError
        from ray.train.torch import TorchTrainer

        from easyfit.data.ray_dataset import hand_to_ray
        inputs, datasets, dataset_config = hand_to_ray(inputs, plan.kind.trains)
        if self.options.elastic:
            check_elastic_ray()
        join_cluster(ray, self.options)
        use_gpu = self._use_gpu(ray)
        resources = worker_resources(self.options.resources_per_worker, use_gpu)
        check_cluster_fits(self.options, self.num_workers, resources, ray.cluster_resources())
        name = f"easyfit-{plan.kind.name}-{uuid.uuid4().hex[:12]}"
        payload = ray.put((function, plan, model, inputs, self.worker_plan))   # read by every worker
        box = mailbox(ray)
        config = dict(zip(CONFIG_KEYS, (payload, box, name, self._fault_tolerance_folder(name))))
        scaling = self._scaling_config(use_gpu, resources)
        trainer = TorchTrainer(run_worker, train_loop_config=config, datasets=datasets, dataset_config=dataset_config,
                               scaling_config=scaling,
                               run_config=self._run_config(name, scaling.elastic_resize_monitor_interval_s))
        try:
            try:
                trainer.fit()
            except WorkerGroupError as error:
                raise worker_failure(error, ray.get(box.failures.remote())) from None
            return cloudpickle.loads(ray.get(box.result.remote()))
        finally:
            ray.kill(box)

    def _elastic_inputs(self, plan, inputs: dict) -> dict:
        """An elastic call's inputs, checked before Ray starts; its fit's options as an elastic fit runs them."""
        from easyfit.data.ray_dataset import is_ray_data
        check_elastic_strategy(plan.run.strategy)
        if not plan.kind.trains:
            return inputs
        check_elastic_data(is_ray_data(inputs.get("x")))
        return {**inputs, "options": elastic_fit_options(inputs["options"], self.max_restarts)}

    def _scaling_config(self, use_gpu: bool, resources: dict):
        from ray.train import ScalingConfig
        interval = {} if self.options.resize_check_s is None else {
            "elastic_resize_monitor_interval_s": self.options.resize_check_s}
        return ScalingConfig(num_workers=self.num_workers, use_gpu=use_gpu, resources_per_worker=resources,
                             placement_strategy=self.placement, **interval)

    def _run_config(self, name: str, resize_check_s: float):
        from ray.train import FailureConfig, RunConfig
        callbacks = None
        if self.options.elastic:   # the group sized on the nodes there are now, not on Ray's view of 20 s ago
            from easyfit.distributed.launchers.ray_cluster_view import FreshClusterView
            callbacks = [FreshClusterView(resize_check_s)]
        return RunConfig(name=name, storage_path=self.options.storage_path, callbacks=callbacks,
                         failure_config=FailureConfig(max_failures=self.max_restarts),
                         worker_runtime_env=self.options.runtime_env)

    def _use_gpu(self, ray) -> bool:
        if self.options.use_gpu is not None:
            return self.options.use_gpu
        if self.accelerator in ("gpu", "cuda"):
            return True
        return self.accelerator == "auto" and ray.cluster_resources().get("GPU", 0) > 0

    def _fault_tolerance_folder(self, name: str) -> str | None:
        """The run's storage path, where a restarted worker group finds easyfit's checkpoint (None: Ray's default
        folder on this machine; a cloud URI keeps it in the workers' default folder)."""
        storage = self.options.storage_path or os.path.join(os.path.expanduser("~"), "ray_results")
        return None if "://" in storage else os.path.join(os.path.abspath(storage), name, DEFAULT_FOLDER)


def import_ray():
    try:
        import ray
        import ray.train
    except ImportError as error:
        raise ImportError(f"launcher='ray' needs Ray Train: {RAY_INSTALL}") from error
    return ray


def join_cluster(ray, options: Ray) -> None:
    """Join the cluster the options or RAY_ADDRESS name (refused at once when it does not answer), the one this
    process joined already (the options checked against it), or start a local one, as `ray.init()` does."""
    if ray.is_initialized():
        check_joined_cluster(ray, options)
        return
    address = options.address or os.environ.get("RAY_ADDRESS")
    if address and address not in ("auto", "local"):
        check_answers(address)
    try:
        ray.init(address=options.address, runtime_env=options.runtime_env)
    except ConnectionError as error:
        raise ConnectionError(f"launcher='ray' found no Ray cluster at {address!r} ({error}). Start one "
                              "(ray start --head), give its address, or leave address and RAY_ADDRESS unset to "
                              "start a local one for the call.") from None


def check_joined_cluster(ray, options: Ray) -> None:
    """Refuse options that the cluster this process joined before the call (its own `ray.init()`) cannot honour:
    an address of another cluster, and local folders or modules in `runtime_env`, which Ray uploads only when a
    process joins a cluster."""
    _check_address(ray, options.address)
    _check_uploads(options.runtime_env)


def _check_address(ray, address: str | None) -> None:
    joined = _joined_address(ray)
    if address not in (None, "auto", "local") and joined is not None and not same_cluster(address, joined, ray):
        raise ValueError(f"launcher=Ray(address={address!r}) names another cluster than the one this process joined "
                         f"before the call (ray.init(), or an earlier call's, at {joined}), and a process joins one "
                         "cluster: leave address out (or 'auto') to train on the joined cluster, or call "
                         f"ray.shutdown() before the call to train on {address!r}.")


def _check_uploads(runtime_env: dict | None) -> None:
    local = {name: entries for name, entries in local_uploads(runtime_env).items() if entries}
    if local:
        named = "; ".join(f"{name}: {', '.join(map(str, entries))}" for name, entries in local.items())
        raise ValueError(f"launcher=Ray(runtime_env=...) names local files ({named}), which Ray uploads to the "
                         "workers only when a process joins the cluster, and this process joined it before the call "
                         "(ray.init(), or an earlier call's). Pass that runtime_env to your own "
                         "ray.init(runtime_env=...) instead: the workers inherit the job's runtime environment; or "
                         "leave out your ray.init() so that the call joins the cluster with Ray(runtime_env=...).")


def _joined_address(ray) -> str | None:
    """The GCS address ("ip:port") of the cluster this process joined; None where Ray does not say (a Ray Client
    connection)."""
    try:
        return ray.get_runtime_context().gcs_address
    except Exception:
        return None


def same_cluster(address: str, joined: str, ray) -> bool:
    """Whether `address` ("host:port", "ray://host:port") names the cluster whose GCS is at `joined` ("ip:port"):
    the same host (this machine's loopback and node address are one) and, for a GCS address, the same port (a
    ray:// address names the head node's client server, on another port)."""
    host, port = _host_and_port(address, ray)
    joined_host, joined_port = _host_and_port(joined, ray)
    return host == joined_host and (address.startswith("ray://") or port == joined_port)


def _host_and_port(address: str, ray) -> tuple[str, str]:
    """(host, port) of an address, the host as an IP address, "this machine" for this machine's own."""
    host, _, port = address.split("://")[-1].rpartition(":")
    try:
        host = socket.gethostbyname(host or "127.0.0.1")
    except OSError:
        return host, port
    here = host.startswith("127.") or host == ray.util.get_node_ip_address()
    return ("this machine" if here else host), port


def local_uploads(runtime_env: dict | None) -> dict[str, list]:
    """The entries of a runtime_env that Ray uploads from this machine: local `py_modules` (paths or modules) and a
    local `working_dir` (anything but a URI, e.g. "s3://...", "gcs://...")."""
    runtime_env = runtime_env or {}
    modules, folder = runtime_env.get("py_modules") or [], runtime_env.get("working_dir")
    return {"py_modules": [entry for entry in modules if not _is_uri(entry)],
            "working_dir": [folder] if folder is not None and not _is_uri(folder) else []}


def _is_uri(entry) -> bool:
    return isinstance(entry, str) and "://" in entry


def check_answers(address: str) -> None:
    """Raise ConnectionError when nothing listens at `address` ("host:port", "ray://host:port")."""
    host, _, port = address.split("://")[-1].rpartition(":")
    try:
        socket.create_connection((host or "127.0.0.1", int(port)), timeout=ADDRESS_TIMEOUT_SECONDS).close()
    except (OSError, ValueError) as error:
        raise ConnectionError(f"launcher='ray': no Ray cluster answers at {address!r} ({error}); check the "
                              "address (host:port of the head node, e.g. 10.0.0.1:6379) and that `ray start --head` "
                              "runs there, or leave address and RAY_ADDRESS unset for a local cluster.") from None


def worker_resources(given: dict | None, use_gpu: bool) -> dict:
    """Each worker's Ray resources: the options' own, else one CPU (and one GPU with GPUs)."""
    resources = dict(given or {})
    resources.setdefault("CPU", 1)
    if use_gpu:
        resources.setdefault("GPU", 1)
    return resources


def check_cluster_fits(options: Ray, num_workers: int, resources: dict, cluster: dict) -> None:
    """Refuse more workers than the cluster can place at once (Ray would wait for them forever): an elastic fit's
    `min`, else all of them."""
    asked = options.num_workers[0] if options.elastic else num_workers
    for name, each in resources.items():
        needed, available = asked * each, cluster.get(name, 0)
        if needed <= available:
            continue
        counted = f"{asked} workers × {each:g} {name} = {needed:g} {name}, but the Ray cluster has {available:g} {name}"
        if options.elastic:
            raise ValueError(f"launcher=Ray(num_workers={options.num_workers}) starts once it can place {counted}: "
                             f"lower min to {int(available // each)} or less, or add nodes to the cluster first.")
        raise ValueError(f"launcher='ray' needs {counted}: ask for fewer devices / num_nodes (or "
                         f"Ray(num_workers=..., resources_per_worker=...)), or add nodes to the cluster.")


def worker_failure(error: Exception, tracebacks: dict[int, str]) -> RankFailedError:
    """The failing worker's own error: the traceback easyfit's rank body recorded, else Ray's account of it (a worker
    that died without raising)."""
    failures = [RankFailedError(rank, text) for rank, text in sorted(tracebacks.items())]
    for rank, cause in sorted(getattr(error, "worker_failures", {}).items()):
        if rank not in tracebacks:
            failures.append(RankFailedError(rank, str(cause).strip() or type(cause).__name__))
    return root_cause(failures) or RankFailedError(0, str(error))
