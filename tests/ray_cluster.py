"""The test session's one local Ray cluster: two nodes of one CPU each on this machine (as Ray's own
`cluster_utils.Cluster` makes them, no dashboard), started by the first test that asks for it and shut down after the
last of the tests that run on it one after the other. Those tests run on one pytest-xdist worker in a row
(tests/work_units.py), so each finds the cluster's CPUs free; starting a cluster costs 15-30 s of a 2-core machine,
once instead of once a module, and an idle one takes a tenth of a core, so it does not outlive its tests."""
from __future__ import annotations

import os
import sys

import pytest

#: the tests on the session's cluster: whole modules, or one test of a module
RAY_TESTS = ("tests/distributed/test_ray_launcher.py", "tests/distributed/test_ray_data.py",
             "tests/distributed/test_ray_nodes.py",
             "tests/test_examples.py::test_ray_cluster_example_fits_on_a_ray_cluster_and_asha_stops_a_bad_trial")


def uses_the_cluster(nodeid: str) -> bool:
    return any(nodeid == test or nodeid.startswith(f"{test}::") for test in RAY_TESTS)


def ray_or_skip():
    """Ray, with Ray Train; the test is skipped, with the pip line, where either is missing."""
    ray = pytest.importorskip("ray", reason='launcher="ray" needs Ray: pip install "easyfit[ray]"')
    pytest.importorskip("ray.train", reason='launcher="ray" needs Ray Train: pip install "easyfit[ray]"')
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    return ray


def by_value(*module_names: str) -> None:
    """The modules' own classes and functions travel to Ray's workers by value (they are not importable there)."""
    from ray import cloudpickle
    for name in module_names:
        cloudpickle.register_pickle_by_value(sys.modules[name])


class SessionCluster:
    """The session fixture's value: the cluster, started when a test first asks for its `address` (again after a
    `shutdown`, where the tests on it do not run in a row: pytest without pytest-xdist)."""

    def __init__(self):
        self.cluster = None

    @property
    def address(self) -> str:
        if self.cluster is None:
            self.cluster = start_cluster()
        return self.cluster.address

    def shutdown(self) -> None:
        if self.cluster is not None:
            self.cluster.shutdown()
            self.cluster = None


#: the session's cluster; conftest's `pytest_runtest_teardown` shuts it down after the last test of a row on it
SESSION = SessionCluster()


def start_cluster():
    """The two nodes, up (the session fixture has skipped its tests where Ray is missing)."""
    from ray.cluster_utils import Cluster
    # Ray Train's controller looks at its workers every 2 s by default, so a run's end waits a second on average
    os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.5")
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    try:
        cluster.add_node(num_cpus=1)
        cluster.wait_for_nodes()
    except BaseException:
        cluster.shutdown()
        raise
    return cluster


def joined(cluster, *module_names: str):
    """A module fixture's body: this process joins the cluster (`ray.init`) for the module's tests and leaves it at
    the module's end (a test module with a cluster of its own starts one beside it); the modules' own classes and
    functions travel to Ray's workers by value (they are not importable there)."""
    import ray
    by_value(*module_names)
    ray.init(address=cluster.address)
    try:
        yield ray
    finally:
        ray.shutdown()
