"""How pytest-xdist hands the tests to its workers (`--dist loadscope`, tests/conftest.py): a module at a time, as
pytest-xdist does, except that the tests on the session's Ray cluster (tests/ray_cluster.py) are one unit, handed out
first: the longest unit (minutes), so that no worker waits at the end for one that took it last."""
from __future__ import annotations

from ray_cluster import uses_the_cluster
from xdist.scheduler import LoadScopeScheduling

RAY_UNIT = "the tests on the session's Ray cluster"


class WorkUnits(LoadScopeScheduling):
    def _split_scope(self, nodeid: str) -> str:
        return RAY_UNIT if uses_the_cluster(nodeid) else super()._split_scope(nodeid)

    def _assign_work_unit(self, node) -> None:
        if RAY_UNIT in self.workqueue:
            self.workqueue.move_to_end(RAY_UNIT, last=False)
        super()._assign_work_unit(node)
