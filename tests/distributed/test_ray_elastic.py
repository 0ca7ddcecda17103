"""An elastic fit on Ray, `launcher=Ray(num_workers=(1, 3))`, on a real local cluster of 1-CPU nodes that the test
changes while the fit runs: it starts on the one node there is, grows to two workers when the test adds a node
(at the start of epoch 2), shrinks to one when the test removes that node mid-epoch (after the checkpoint of step 4
of epoch 2), and ends. The fit equals a plain PyTorch replay of that sequence of worlds (the same global sample order
cut at the same steps, each step's LR scaled for its world), and every sample of every epoch is trained once.

The resizes happen at known points without sleeps: rank 0 writes a signal file, the test adds / removes the node when
it sees it, and the workers wait there until Ray's resize stops them. Refusals (no Ray run) come first."""
from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from ray_cluster import by_value, ray_or_skip
from ray_common import LR, make_data, make_net
from torch import nn

import easyfit
from easyfit.callbacks import Callback
from easyfit.distributed.launchers.failures import RankFailedError
from easyfit.launchers import Ray

pytestmark = pytest.mark.timeout(600)
SAMPLES, BATCH, EVERY, EPOCHS = 48, 4, 2, 3
#: the worlds the fit trains each epoch on: (workers, samples of the epoch's global order they train)
WORLDS = [[(1, 48)], [(2, 32), (1, 16)], [(1, 48)]]
SHRINK_AT_STEP = 4   # of epoch 2 on two workers: 4 steps × 2 workers × BATCH = 32 samples
WAIT_SECONDS = 240   # how long the workers wait for a resize the test was asked for
#: the strategies whose elastic fit is checked against the replay: ddp; EASYFIT_ELASTIC_STRATEGIES=all adds fsdp with
#: a whole and a sharded checkpoint, zero and ddp_sharded (one to two minutes each of a 2-core machine; CI runs them)
RESIZED = ["ddp"] + (["fsdp", "fsdp-sharded", "zero", "ddp_sharded"]
                     if os.environ.get("EASYFIT_ELASTIC_STRATEGIES") == "all" else [])


@pytest.fixture(scope="module")
def cluster():
    """A local cluster of one 1-CPU head node (which holds the caller), to which the tests add 1-CPU nodes."""
    ray = ray_or_skip()
    from ray.cluster_utils import Cluster
    by_value(__name__, "ray_common")
    nodes = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    ray.init(address=nodes.address)
    try:
        yield nodes
    finally:
        ray.shutdown()
        nodes.shutdown()


def model(strategy_net: nn.Module | None = None) -> easyfit.Model:
    return easyfit.Model(strategy_net or make_net(), loss="mse", optimizer="sgd", lr=LR)


def data():
    """make_data's samples with each sample's index as a last input column (the Recorder drops it)."""
    x, y = make_data(SAMPLES)
    return torch.cat([x, torch.arange(SAMPLES, dtype=x.dtype)[:, None]], dim=1), y


class Recorder(nn.Module):
    """Drops the last input column (the sample's index), keeping the indices of the batch it trains last in the
    class (a sharding strategy trains a copy of the net)."""

    last: list[int] = []

    def forward(self, x):
        if self.training:
            type(self).last = [int(index) for index in x[:, -1]]
        return x[:, :-1]


class Resizes(Callback):
    """Rank 0 asks the test for a node (epoch 2 begins on one worker) and for the node to go (before step 5 of
    epoch 2 on two workers, after the checkpoint of step 4); every worker then waits to be stopped by the resize,
    unless the test marked that resize done (before it changed the cluster: this is the resized group). Every worker
    of every attempt leaves its process id, and each step's (world, epoch, step, samples)."""

    may_stop_training = False

    def __init__(self, folder: str):
        self.folder = folder

    def on_train_begin(self, logs=None):
        self.world = self.model.strategy.world_size
        Path(self.folder, f"worker-{os.getpid()}.pid").touch()

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch
        if self.world == 1 and epoch == 1:
            self.resize("grow")

    def on_train_batch_begin(self, batch, logs=None):
        if self.world == 2 and self.epoch == 1 and batch == SHRINK_AT_STEP:
            self.resize("shrink")

    def on_train_batch_end(self, batch, logs=None):
        samples = " ".join(map(str, Recorder.last))
        with open(os.path.join(self.folder, f"steps-{os.getpid()}.txt"), "a") as file:
            file.write(f"{self.world} {self.epoch} {batch} {samples}\n")

    def resize(self, signal: str) -> None:
        if Path(self.folder, f"{signal}-done").exists():   # this is the resized group
            return
        if self.model.global_rank == 0:
            Path(self.folder, signal).touch()
        deadline = time.monotonic() + WAIT_SECONDS
        while time.monotonic() < deadline:   # Ray's resize ends this process
            time.sleep(0.05)
        raise RuntimeError(f"the worker group was not resized within {WAIT_SECONDS} s of asking to {signal}")


def replay(x, y) -> tuple[list[float], dict]:
    """Plain PyTorch over WORLDS: each epoch's samples in order, a step on `workers × BATCH` of them at LR × workers
    (linear scaling); the epoch's loss is the mean over its samples of the loss of the step that trained them."""
    net = make_net()
    optimizer = torch.optim.SGD(net.parameters(), lr=LR)
    losses = []
    for segments in WORLDS:
        total, start = 0.0, 0
        for workers, samples in segments:
            for group in optimizer.param_groups:
                group["lr"] = LR * workers
            for begin in range(start, start + samples, workers * BATCH):
                inputs, target = x[begin:begin + workers * BATCH, :-1], y[begin:begin + workers * BATCH]
                loss = F.mse_loss(net(inputs), target)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                total += float(loss.detach()) * len(inputs)
            start += samples
        losses.append(total / SAMPLES)
    return losses, net.state_dict()


def steps_trained(folder: Path) -> dict[int, list[tuple[int, int, list[int]]]]:
    """Epoch -> the (world, step, samples) of every step every worker finished, ordered by step."""
    epochs: dict[int, list] = {}
    for path in folder.glob("steps-*.txt"):
        for line in path.read_text().splitlines():
            world, epoch, step, *samples = map(int, line.split())
            epochs.setdefault(epoch, []).append((world, step, samples))
    return {epoch: sorted(steps, key=lambda entry: entry[1]) for epoch, steps in sorted(epochs.items())}


def wait_for(condition, seconds: float, while_alive: threading.Thread | None = None) -> bool:
    """Whether `condition()` holds within `seconds` (checked every 0.05 s; False at once if the thread ended)."""
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline or (while_alive is not None and not while_alive.is_alive()):
            return False
        time.sleep(0.05)
    return True


def alive(pid: int) -> bool:
    import psutil
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def fit_while_resizing(cluster, folder: Path, strategy) -> tuple[easyfit.Model, object]:
    """The elastic fit in a thread, while this thread adds a node when rank 0 asks to grow and removes it when rank
    0 asks to shrink (Ray's cluster utilities change nodes from the main thread only)."""
    fitted, outcome = model(nn.Sequential(Recorder(), make_net())), {}

    def fit():
        try:
            outcome["history"] = fitted.fit(
                *data(), batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=2, strategy=strategy,
                callbacks=[Resizes(str(folder))], fault_tolerance_every_n_steps=EVERY,
                launcher=Ray(num_workers=(1, 3), resize_check_s=1, storage_path=str(folder)))
        except BaseException as error:
            outcome["error"] = error

    thread = threading.Thread(target=fit)
    thread.start()
    try:
        assert wait_for((folder / "grow").exists, WAIT_SECONDS, thread), outcome.get("error")
        (folder / "grow-done").touch()   # for the group that the new node makes
        node = cluster.add_node(num_cpus=1)
        assert wait_for((folder / "shrink").exists, WAIT_SECONDS, thread), outcome.get("error")
        (folder / "shrink-done").touch()
        cluster.remove_node(node)
    finally:
        thread.join(timeout=WAIT_SECONDS)
    if "error" in outcome:
        raise outcome["error"]
    return fitted, outcome["history"]


@pytest.mark.parametrize("num_workers, error", [
    ((3, 1), r"max 1 < min 3; give \(min, max\) with min <= max"),
    ((0, 2), r"an elastic fit takes \(min, max\), two positive integers"),
])
def test_an_elastic_range_that_is_not_one_is_refused(num_workers, error):
    with pytest.raises(ValueError, match=error):
        Ray(num_workers=num_workers)


@pytest.mark.parametrize("options", [{"resize_check_s": 1}, {"num_workers": (1, 3), "resize_check_s": -1}])
def test_resize_check_s_is_an_elastic_fits_number_of_seconds(options):
    with pytest.raises(ValueError, match=r"is the seconds between an elastic fit's checks for more workers"):
        Ray(**options)


@pytest.mark.parametrize("strategy, why", [
    ("tp", "splits every layer over exactly the workers it started with"),
    ("pipeline", "its stages are the workers"),
    ("deepspeed_stage_2", "one optimizer partition per worker"),
])
def test_a_strategy_that_cannot_resize_is_refused_before_ray_starts(strategy, why):
    import ray
    joined = ray.is_initialized()
    with pytest.raises(ValueError, match=rf"strategy='{strategy}' cannot change its number of workers mid-fit.*{why}"):
        model().fit(*make_data(), strategy=strategy, launcher=Ray(num_workers=(1, 3)))
    assert ray.is_initialized() == joined   # no cluster was joined or started for it


def test_devices_num_nodes_or_no_checkpoint_are_refused_for_an_elastic_fit():
    with pytest.raises(ValueError, match=r"devices=2 × num_nodes=1 asks for 2 workers, but launcher=Ray\(num_workers="
                                         r"\(1, 3\)\) takes between 1 and 3.*leave devices and num_nodes out"):
        model().fit(*make_data(), devices=2, strategy="ddp", launcher=Ray(num_workers=(1, 3)))
    with pytest.raises(ValueError, match="fault_tolerance=False turns off the checkpoint"):
        model().fit(*make_data(), strategy="ddp", fault_tolerance=False, launcher=Ray(num_workers=(1, 3)))


def test_a_ray_train_without_elastic_worker_groups_is_refused_with_the_pip_line(monkeypatch):
    from ray.train import ScalingConfig
    monkeypatch.delattr(ScalingConfig, "elasticity_enabled")
    with pytest.raises(ImportError, match=r"an elastic fit needs Ray Train's elastic worker groups .*pip install"):
        model().fit(*make_data(), strategy="ddp", launcher=Ray(num_workers=(1, 3)))


def test_a_min_the_cluster_cannot_hold_is_refused_naming_both(cluster):
    with pytest.raises(ValueError, match=r"Ray\(num_workers=\(2, 3\)\) starts once it can place 2 workers × 1 CPU = "
                                         r"2 CPU, but the Ray cluster has 1 CPU: lower min to 1"):
        model().fit(*make_data(), strategy="ddp", launcher=Ray(num_workers=(2, 3)))


def test_a_ray_dataset_to_train_on_is_refused_for_an_elastic_fit(cluster):
    import ray
    rows = ray.data.from_items([{"x": [0.0, 1.0, 2.0, 3.0], "y": [1.0]}] * 8)
    with pytest.raises(ValueError, match="which a ray.data.Dataset streamed by Ray Data does not have"):
        model().fit(rows, strategy="ddp", launcher=Ray(num_workers=(1, 3)))


def test_a_node_added_or_removed_is_seen_as_soon_as_the_run_sizes_a_group(cluster):
    """Ray's autoscaling coordinator, which sizes an elastic run's groups, looks at the nodes every 20 s; the run's
    FreshClusterView has it look again when a group is sized."""
    import ray
    from ray.data._internal.cluster_autoscaler.default_autoscaling_coordinator import (
        get_or_create_autoscaling_coordinator,
    )

    from easyfit.distributed.launchers.ray_cluster_view import FreshClusterView
    coordinator, view = get_or_create_autoscaling_coordinator(), FreshClusterView(interval_s=60)

    def nodes_reserved() -> int:   # the nodes on which the coordinator reserves the 3 workers' CPUs asked for below
        return len(ray.get(coordinator.get_reserved_resources.remote("easyfit-test")))

    ray.get(coordinator.request_resources.remote(requester_id="easyfit-test", resources=[{"CPU": 1}] * 3,
                                                 expire_after_s=120))
    try:
        assert nodes_reserved() == 1
        node = cluster.add_node(num_cpus=1)
        view.refresh()
        assert nodes_reserved() == 2
        cluster.remove_node(node)
        view.refresh()
        assert nodes_reserved() == 1
    finally:
        ray.get(coordinator.cancel_request.remote("easyfit-test"))


class FailsInEpochTwo(Callback):
    def on_epoch_begin(self, epoch, logs=None):
        if epoch == 1:
            raise ValueError("a bug in epoch 2")


def test_an_error_in_an_elastic_fit_reaches_the_caller_once_its_restarts_are_spent(cluster, tmp_path):
    """A worker that raises is a lost worker group to Ray: the group restarts (max_restarts times) and continues from
    the checkpoint, and raises again; then the caller gets the worker's own traceback."""
    with pytest.raises(RankFailedError, match="a bug in epoch 2") as failure:
        model().fit(*make_data(), batch_size=BATCH, epochs=2, verbose=0, strategy="ddp", max_restarts=1,
                    callbacks=[FailsInEpochTwo()], launcher=Ray(num_workers=(1, 3), storage_path=str(tmp_path)))
    assert "on_epoch_begin" in failure.value.details


@pytest.mark.parametrize("strategy", RESIZED)
def test_an_elastic_fit_grows_and_shrinks_with_the_cluster_and_equals_the_replay(cluster, tmp_path, strategy):
    """fsdp-sharded: each worker writes its shards of the checkpoint, which the next group's workers re-shard; zero
    and ddp_sharded consolidate the optimizer state on saving and partition it again on loading."""
    if strategy == "ddp_sharded":
        pytest.importorskip("fairscale", reason="ddp_sharded needs fairscale: pip install easyfit[fairscale]")
    if strategy == "fsdp-sharded":
        strategy = easyfit.strategies.FSDP(state_dict_type="sharded")
    fitted, history = fit_while_resizing(cluster, tmp_path, strategy)
    x, y = data()
    losses, weights = replay(x, y)
    # every sample of every epoch trained once, on the worlds asked for, at the steps asked for
    epochs = steps_trained(tmp_path)
    for epoch, segments in enumerate(WORLDS):
        steps = epochs[epoch]
        assert sorted(index for _, _, samples in steps for index in samples) == list(range(SAMPLES)), epoch
        worlds = [(world, sum(len(samples) for at, _, samples in steps if at == world)) for world, _ in segments]
        assert worlds == segments, (epoch, steps)
    # the weights and every epoch's loss of the replay
    assert history.history["loss"] == pytest.approx(losses, abs=1e-5)
    for name, value in fitted.net[1].state_dict().items():
        torch.testing.assert_close(value, weights[name], atol=1e-5, rtol=0)
    assert ("resumed after restart 2 from epoch 2, step 4; world size 2 → 1: the data re-sharded over 1 process "
            "(the epoch continues at step 8), lr 0.2 → 0.1") in history.params["summary"]
    # nothing of the run is left: the workers of the three groups (1, 2, 1) ended, the cluster's CPUs are free
    workers = [int(path.stem.split("-")[1]) for path in tmp_path.glob("worker-*.pid")]
    assert len(workers) == 4, workers
    assert wait_for(lambda: not any(alive(pid) for pid in workers), 30), [pid for pid in workers if alive(pid)]
    import ray
    assert wait_for(lambda: ray.available_resources().get("CPU") == ray.cluster_resources()["CPU"] == 1, 30), \
        (ray.available_resources(), ray.cluster_resources())
