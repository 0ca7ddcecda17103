"""A worker of easyfit's Ray Train run (`launcher="ray"`): it plans the call again where Ray's worker context is the
launch environment, runs the rank body, and rank 0 posts its result to the run's mailbox (an actor in the caller's
cluster); a failing worker posts its traceback there before Ray stops the group."""
from __future__ import annotations

import os
import traceback

from easyfit.distributed.environments import RESTART_COUNT_VARIABLE
from easyfit.distributed.environments.ray_train import RAY_LAUNCHED_VARIABLE
from easyfit.distributed.fault_tolerance import RUN_ID_VARIABLE

#: the worker's `train_loop_config`: the pickled call in the object store, the mailbox, the run's name, and the
#: folder of its fault-tolerance checkpoint
CONFIG_KEYS = ("payload", "mailbox", "run_name", "fault_tolerance")


def run_worker(config: dict) -> None:
    """Ray Train's `train_loop_per_worker` for a call of easyfit's."""
    import ray
    import ray.train
    from ray import cloudpickle

    from easyfit.callbacks.ray_report import RayTrainReport
    from easyfit.data.ray_dataset import worker_inputs

    box, rank = config["mailbox"], ray.train.get_context().get_world_rank()
    try:
        os.environ.update({RAY_LAUNCHED_VARIABLE: "1", RUN_ID_VARIABLE: config["run_name"]})
        if rank == 0:   # rank 0 decides the restart for all (easyfit.distributed.fault_tolerance)
            os.environ[RESTART_COUNT_VARIABLE] = str(ray.get(box.attempt.remote()))
        function, plan, model, inputs, worker_plan = ray.get(config["payload"])
        inputs = worker_inputs(inputs)
        options = inputs["options"]
        if plan.kind.trains:   # its epochs reported to Ray; its checkpoint kept in the run's storage
            given = options.fault_tolerance
            options = inputs["options"] = options.replace(
                callbacks=[*options.callbacks, RayTrainReport()],
                fault_tolerance=config["fault_tolerance"] if given is None else given)
        result = function(worker_plan(plan, model, options), model=model, **inputs)
    except BaseException:
        ray.get(box.failed.remote(rank, traceback.format_exc()))
        raise
    if rank == 0:
        ray.get(box.put.remote(cloudpickle.dumps(result)))


def mailbox(ray):
    """A new mailbox actor for one run, placed on the caller's node (which outlives the workers' nodes) without
    taking a CPU from the workers. Its class is made here, so Ray sends it by value: the actor's process imports
    neither easyfit nor torch (seconds of a small cluster's CPU while the workers start)."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    class Mailbox:
        """Where a run's rank 0 leaves its result, failing workers their tracebacks, and rank 0 counts its
        attempts."""

        def __init__(self):
            self._result, self._failures, self._attempts = None, {}, 0

        def attempt(self) -> int:
            """The restart this attempt is (0: the first)."""
            self._attempts += 1
            return self._attempts - 1

        def put(self, result: bytes) -> None:
            self._result = result

        def failed(self, rank: int, details: str) -> None:
            self._failures[rank] = details

        def result(self) -> bytes | None:
            return self._result

        def failures(self) -> dict:
            return dict(self._failures)

    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    return ray.remote(num_cpus=0, scheduling_strategy=here)(Mailbox).remote()
