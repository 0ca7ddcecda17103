"""launcher="ray" over two Ray nodes on this machine (the session's cluster, tests/ray_cluster.py: a head and a second
node of one CPU each, as Ray's own `cluster_utils.Cluster` makes them): num_nodes=2 spreads the workers, one on each,
and the fit equals plain PyTorch on the combined batch, as the one-node run does (test_ray_launcher.py)."""
from __future__ import annotations

import pytest
import torch
from ray_common import BATCH, EPOCHS, LR, assert_like_plain, make_data, make_net, on_the_cluster, plain_fit

import easyfit
from easyfit.callbacks import Callback

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def two_nodes(ray_cluster):
    yield from on_the_cluster(__name__, ray_cluster)


class WhereAmI(Callback):
    """Each rank leaves its Ray node's id in a file of its own. (Ray Train counts nodes by IP address, so its node
    ranks and local ranks take these two for one machine: both are node 0, local ranks 0 and 1.)"""

    def __init__(self, folder: str):
        self.folder = folder

    def on_train_begin(self, logs=None):
        import ray
        torch.save(ray.get_runtime_context().get_node_id(), f"{self.folder}/rank{self.model.global_rank}.pt")


def test_two_nodes_take_a_worker_each_and_train_as_one_node(two_nodes, tmp_path):
    x, y = make_data()
    fitted = easyfit.Model(make_net(), loss="mse", optimizer="sgd", lr=LR)
    history = fitted.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0, lr_scaling=None,
                         callbacks=[WhereAmI(str(tmp_path))], devices=1, num_nodes=2, strategy="ddp",
                         launcher=easyfit.launchers.Ray(storage_path=str(tmp_path)))
    nodes = [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(2)]
    assert nodes[0] != nodes[1], "both workers ran on one Ray node"
    assert_like_plain(history, fitted.net, plain_fit(x, y, 2 * BATCH))
