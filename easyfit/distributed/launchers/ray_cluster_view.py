"""An elastic Ray Train run decides its number of workers from Ray's autoscaling coordinator, whose view of the
cluster's nodes is refreshed every 20 s: a group restarted after a node was lost could be sized for the node that is
gone (and wait a minute for it before Ray gives up), and a node added is seen only at the next refresh. This
controller callback has the coordinator look at the cluster again before each such decision. Imported only for an
elastic run (it imports Ray)."""
from __future__ import annotations

import logging
import time

import ray
from ray.train.v2._internal.execution.callback import ControllerCallback
from ray.train.v2._internal.execution.controller.state import (
    InitializingState,
    ReschedulingState,
    RestartingState,
    RunningState,
)

#: how long one refresh may take before the decision goes on with the view it has
REFRESH_TIMEOUT_SECONDS = 5.0
logger = logging.getLogger(__name__)


class FreshClusterView(ControllerCallback):
    """Refreshes the coordinator's view of the nodes when the controller is about to size a worker group: when it
    (re)starts one, and every `interval_s` while one runs (when the elastic policy looks for more workers)."""

    def __init__(self, interval_s: float):
        self.interval_s, self.refreshed = interval_s, float("-inf")

    def after_controller_state_update(self, previous_state, current_state) -> None:
        sizing = isinstance(current_state, (InitializingState, RestartingState, ReschedulingState))
        due = isinstance(current_state, RunningState) and time.monotonic() - self.refreshed >= self.interval_s
        if sizing or due:
            self.refresh()

    def refresh(self) -> None:
        from ray.data._internal.cluster_autoscaler.default_autoscaling_coordinator import (
            get_or_create_autoscaling_coordinator,
        )
        self.refreshed = time.monotonic()
        try:   # any requester's recomputed reservation refreshes the nodes the coordinator sees
            ray.get(get_or_create_autoscaling_coordinator().get_reserved_resources.remote("easyfit", recompute=True),
                    timeout=REFRESH_TIMEOUT_SECONDS)
        except Exception as error:   # the decision goes on with the view the coordinator has
            logger.warning("easyfit could not refresh Ray's view of the cluster before sizing the worker group: %s",
                           error)
