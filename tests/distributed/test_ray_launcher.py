"""launcher="ray": the call runs as a Ray Train TorchTrainer of 2 CPU workers on a real local Ray cluster (the
session's, tests/ray_cluster.py); the caller gets the History, the trained weights, the callbacks' state, evaluate's and
predict's results, and a failing worker's own traceback. Checks that need no Ray Train run (the refusals) come first."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch
from ray_common import BATCH, EPOCHS, LR, assert_like_plain, make_data, make_net, on_the_cluster, plain_fit

import easyfit
from easyfit.callbacks import Callback
from easyfit.distributed.launchers.failures import RankFailedError
from easyfit.distributed.launchers.ray_train import join_cluster

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def cluster(ray_cluster):
    yield from on_the_cluster(__name__, ray_cluster)


def model():
    return easyfit.Model(make_net(), loss="mse", optimizer="sgd", lr=LR)


def ray_fit(tmp_path, callbacks=(), **run):
    """A fit on 2 workers (SGD, no LR scaling, in order), as the module's other fits."""
    x, y = make_data()
    fitted = model()
    history = fitted.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=2, lr_scaling=None,
                         callbacks=list(callbacks), devices=2,
                         launcher=easyfit.launchers.Ray(storage_path=str(tmp_path)), **{"strategy": "ddp", **run})
    return fitted, history


class Recorder(Callback):
    """State that rank 0's copy ends with and the caller's object gets back."""

    def on_train_begin(self, logs=None):
        self.epochs, self.rank, self.pid = [], self.model.global_rank, os.getpid()

    def on_epoch_end(self, epoch, logs=None):
        self.epochs.append(epoch)


class FailOnRankOne(Callback):
    def __init__(self, stamp: str):
        self.stamp = stamp

    def on_epoch_begin(self, epoch, logs=None):
        if self.model.global_rank == 1 and epoch == 1:
            with open(self.stamp, "w") as file:
                file.write(repr(time.time()))
            raise ValueError("rank one fails on purpose")


class ExitOnceOnRankOne(Callback):
    """Rank 1's process dies at the start of epoch 2 of the first attempt only; `begun`: the epochs the last
    attempt began. Every worker of every attempt leaves its process id in the marker's folder."""

    def __init__(self, marker: str):
        self.marker = marker

    def on_train_begin(self, logs=None):
        self.begun = []
        open(os.path.join(os.path.dirname(self.marker), f"worker-{os.getpid()}.pid"), "w").close()

    def on_epoch_begin(self, epoch, logs=None):
        self.begun.append(epoch)
        if self.model.global_rank == 1 and epoch == 1 and not os.path.exists(self.marker):
            open(self.marker, "w").close()
            os._exit(1)


@pytest.fixture(scope="module")
def ddp_run(cluster, tmp_path_factory):
    recorder = Recorder()
    fitted, history = ray_fit(tmp_path_factory.mktemp("ray"), [recorder])
    return fitted, history, recorder


@pytest.mark.parametrize("strategy", ["dp", "horovod", "xla", "bagua", "ddp_spawn"])
def test_a_strategy_ray_cannot_host_is_refused_before_ray_starts(strategy):
    with pytest.raises(ValueError, match=rf"strategy='{strategy}'.*launcher='ray'"):
        model().fit(*make_data(), devices=2, strategy=strategy, launcher="ray")


def test_launcher_ray_without_ray_says_the_pip_line(monkeypatch):
    import importlib.util
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *args: None if name.startswith("ray") else real(name, *args))
    with pytest.raises(ImportError, match=r'pip install "easyfit\[ray\]"'):
        model().fit(*make_data(), devices=2, strategy="ddp", launcher="ray")


def test_a_bad_launcher_value_is_refused():
    with pytest.raises(ValueError, match='launcher must be "auto", "ray" or easyfit.launchers.Ray'):
        model().fit(*make_data(), launcher="slurm")
    with pytest.raises(ValueError, match="num_workers"):
        easyfit.launchers.Ray(num_workers=0)


def test_an_address_that_does_not_answer_is_refused_within_30_seconds(tmp_path):
    script = ("import torch, easyfit\n"
              "model = easyfit.Model(torch.nn.Linear(4, 1), loss='mse')\n"
              "model.fit(torch.randn(8, 4), torch.randn(8, 1), devices=2, strategy='ddp',\n"
              "          launcher=easyfit.launchers.Ray(address='127.0.0.1:9'))\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "EASYFIT_REPORT_TIME": "1"})
    assert done.returncode != 0
    assert "no Ray cluster answers at '127.0.0.1:9'" in done.stderr


def test_more_workers_than_the_cluster_has_cpus_is_refused_naming_both(cluster):
    with pytest.raises(ValueError, match=r"needs 3 workers × 1 CPU = 3 CPU, but the Ray cluster has 2 CPU"):
        model().fit(*make_data(), devices=3, strategy="ddp", launcher="ray")


def test_a_joined_cluster_refuses_another_address_and_takes_its_own(cluster):
    """The test process joined the module's cluster (ray.init): an address of another is refused before training."""
    with pytest.raises(ValueError, match=r"Ray\(address='127.0.0.1:1'\) names another cluster than the one this "
                                         r"process joined .*leave address out.*ray.shutdown\(\)"):
        model().fit(*make_data(), devices=2, strategy="ddp", launcher=easyfit.launchers.Ray(address="127.0.0.1:1"))
    joined = cluster.get_runtime_context().gcs_address
    port = joined.rpartition(":")[2]
    for address in (joined, f"127.0.0.1:{port}", f"localhost:{port}", "auto", None):   # this cluster: no error
        join_cluster(cluster, easyfit.launchers.Ray(address=address))
    assert cluster.get_runtime_context().gcs_address == joined


def test_local_files_in_the_runtime_env_of_a_joined_process_are_refused_saying_where_they_go(cluster, tmp_path):
    """Ray uploads local py_modules / working_dir only at ray.init: a joined process is told to pass them there."""
    local = easyfit.launchers.Ray(runtime_env={"py_modules": [str(tmp_path)], "working_dir": "."})
    with pytest.raises(ValueError, match=rf"names local files \(py_modules: {tmp_path}; working_dir: \.\).*your own "
                                         r"ray.init\(runtime_env=\.\.\.\) instead"):
        model().fit(*make_data(), devices=2, strategy="ddp", launcher=local)
    join_cluster(cluster, easyfit.launchers.Ray(runtime_env={"py_modules": ["s3://bucket/module.zip"],
                                                             "working_dir": "gs://bucket/folder.zip",
                                                             "env_vars": {"A": "1"}}))   # nothing to upload


def test_ddp_on_ray_equals_plain_pytorch_on_the_combined_batch(ddp_run):
    fitted, history, recorder = ddp_run
    x, y = make_data()
    assert_like_plain(history, fitted.net, plain_fit(x, y, 2 * BATCH))
    assert fitted.history is history
    assert recorder.epochs == list(range(EPOCHS)) and recorder.rank == 0 and recorder.pid != os.getpid()


def test_evaluate_is_exact_and_predict_returns_every_sample_in_order(ddp_run):
    fitted = ddp_run[0]
    x, y = make_data(37)   # odd: the workers' shares differ
    expected = fitted.evaluate(x, y, verbose=0)
    on_ray = fitted.evaluate(x, y, verbose=0, batch_size=5, devices=2, strategy="ddp", launcher="ray")
    assert on_ray == pytest.approx(expected, abs=1e-6)
    predicted = fitted.predict(x, batch_size=5, devices=2, strategy="ddp", launcher="ray")
    with torch.no_grad():
        torch.testing.assert_close(predicted, fitted.net(x), atol=1e-6, rtol=0)


#: the sharded strategies fitted on Ray: fsdp and a DeepSpeed stage; EASYFIT_RAY_STRATEGIES=all adds tensor
#: parallelism and the pipeline (25-35 s each of a 2-core machine; CI runs them)
ON_RAY = ["fsdp", "deepspeed_stage_2"] + (["tp", "pipeline"] if os.environ.get("EASYFIT_RAY_STRATEGIES") == "all"
                                          else [])


@pytest.mark.parametrize("strategy", ON_RAY)
def test_sharded_strategies_on_ray_equal_plain_pytorch_on_the_combined_batch(cluster, tmp_path, strategy):
    if strategy.startswith("deepspeed"):
        pytest.importorskip("deepspeed", reason="DeepSpeed is not installed: pip install easyfit[deepspeed]")
    fitted, history = ray_fit(tmp_path, strategy=strategy)
    # tensor parallelism and a pipeline of two stages: both workers take the same batch
    replicas = 1 if strategy in ("tp", "pipeline") else 2
    assert_like_plain(history, fitted.net, plain_fit(*make_data(), replicas * BATCH))


def test_an_exception_on_rank_1_reaches_the_caller_with_its_traceback_within_30_seconds(cluster, tmp_path):
    stamp = tmp_path / "raised"
    with pytest.raises(RankFailedError) as failure:
        ray_fit(tmp_path, [FailOnRankOne(str(stamp))])
    waited = time.time() - float(stamp.read_text())
    assert failure.value.rank == 1
    assert "rank one fails on purpose" in failure.value.details and "on_epoch_begin" in failure.value.details
    assert waited < 30, f"the caller heard of rank 1's error {waited:.0f} s after it was raised"


def test_a_worker_killed_in_epoch_2_restarts_and_ends_bit_for_bit_as_the_fit_that_never_failed(cluster, ddp_run,
                                                                                                tmp_path):
    killer = ExitOnceOnRankOne(str(tmp_path / "killed"))
    fitted, history = ray_fit(tmp_path, [killer], max_restarts=1)
    assert (tmp_path / "killed").exists()
    assert killer.begun == [1, 2]   # the restarted group began at epoch 2, from the checkpoint of epoch 1's end
    assert not list(tmp_path.glob("*/.easyfit-fault-tolerance/*"))   # removed once the fit ended well
    never_failed, never_history, _ = ddp_run
    assert history.history == never_history.history
    for name, value in fitted.net.state_dict().items():
        assert torch.equal(value, never_failed.net.state_dict()[name]), name
    # nothing of the run is left: the four workers' processes (two attempts) end, the cluster's CPUs are free again
    workers = [int(path.stem.split("-")[1]) for path in tmp_path.glob("worker-*.pid")]
    assert len(workers) == 4, workers
    assert wait_for(lambda: not any(alive(pid) for pid in workers)), [pid for pid in workers if alive(pid)]
    assert wait_for(lambda: cluster.available_resources().get("CPU") == cluster.cluster_resources()["CPU"]), \
        (cluster.available_resources(), cluster.cluster_resources())


def alive(pid: int) -> bool:
    import psutil
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def wait_for(condition, seconds: float = 30.0) -> bool:
    """Whether `condition()` holds within `seconds` (checked every 0.2 s)."""
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True
