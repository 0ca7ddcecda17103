"""Shared tiny fixtures: seeded data and small nets that train in milliseconds on a CPU."""
from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from nets import tiny_net

from easyfit.distributed.strategy_parts.cpu_threads import CoreShare, available_cores


@pytest.fixture(scope="session")
def ray_cluster():
    """The session's local Ray cluster (tests/ray_cluster.py)."""
    from ray_cluster import SESSION, ray_or_skip
    ray_or_skip()
    yield SESSION
    SESSION.shutdown()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    """After the last of a row of tests on the session's Ray cluster (their fixtures torn down), the cluster ends."""
    yield
    if "ray_cluster" in item.fixturenames and (nextitem is None or "ray_cluster" not in nextitem.fixturenames):
        from ray_cluster import SESSION
        SESSION.shutdown()


@pytest.hookimpl(optionalhook=True)   # a hook of pytest-xdist's: run without it (-p no:xdist), pytest has no such hook
def pytest_xdist_make_scheduler(config, log):
    """pytest-xdist hands out whole modules (`--dist loadscope`), with the tests on the session's Ray cluster as one
    unit handed out first (tests/work_units.py)."""
    if config.getvalue("dist") == "loadscope":
        from work_units import WorkUnits
        return WorkUnits(config, log)
    return None


@pytest.fixture
def make_net():
    """make_net(in_features=4, out_features=3, seed=0, dropout=0.0) -> a fresh tiny MLP."""
    return tiny_net


@pytest.fixture
def classification() -> tuple[torch.Tensor, torch.Tensor]:
    """101 samples (an uneven last batch for most batch sizes), 4 features, 3 learnable classes."""
    x = torch.randn(101, 4, generator=torch.Generator().manual_seed(0))
    return x, (x[:, 0] > 0).long() + (x[:, 1] > 0.5).long()


@pytest.fixture
def regression() -> tuple[torch.Tensor, torch.Tensor]:
    """64 samples, 4 features, one float target column."""
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(64, 4, generator=generator)
    return x, x @ torch.tensor([[1.0], [-2.0], [0.5], [0.0]]) + 0.1 * torch.randn(64, 1, generator=generator)


def pytest_configure(config):
    """A pytest-xdist worker (`pytest -n 2`) runs the tests from code its controller sent, so its `__main__` has no
    file, which easyfit takes for a notebook (no script to re-run in new ranks); give it the file `python -m pytest`
    has, so that every worker sees what one pytest process sees."""
    main = sys.modules["__main__"]
    if os.environ.get("PYTEST_XDIST_WORKER") and getattr(main, "__file__", None) is None:
        main.__file__ = str(Path(pytest.__file__).with_name("__main__.py"))
    share_the_cores()
    own_ray_folder(config)


def own_ray_folder(config) -> None:
    """Each pytest process that runs tests (and what it starts) keeps its Ray clusters in a folder of its own: Ray's
    `ray.init()` joins the cluster named in the default folder's `ray_current_cluster`, which a multi-node test
    cluster of another pytest-xdist worker writes there, so a worker's own local cluster could not start beside it.
    A folder the user chose (RAY_TMPDIR) is kept."""
    controller = bool(getattr(config.option, "numprocesses", None)) and not hasattr(config, "workerinput")
    if not controller and "RAY_TMPDIR" not in os.environ:
        os.environ["RAY_TMPDIR"] = config.ray_folder = tempfile.mkdtemp(prefix="ray-")


def pytest_unconfigure(config):
    if hasattr(config, "ray_folder"):
        shutil.rmtree(config.ray_folder, ignore_errors=True)


@pytest.fixture
def all_cores():
    """The test runs with a thread per core, as a user's process starts (a pytest-xdist worker has its share)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(available_cores())
    yield
    torch.set_num_threads(previous)


def share_the_cores() -> None:
    """A pytest-xdist worker trains with its share of the cores (`-n auto`: one thread each), unless OMP_NUM_THREADS
    chose. With a thread per core in every worker, each in-process test's threads waited, spinning, for cores the other
    workers held: the compile tests took 30% more CPU time (and 8% more with a pool of inductor compile processes a
    worker)."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", 1))
    if workers < 2 or "OMP_NUM_THREADS" in os.environ:
        return
    CoreShare().apply(workers)   # easyfit's own share for ranks on one machine's CPU, kept for the session
    if torch.get_num_threads() == 1:   # read when inductor's config is first imported: a compile pool has no core
        os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")


def pytest_collection_modifyitems(config, items):
    """Tests marked `gpu` run where torch sees a CUDA GPU and are skipped, with the reason, elsewhere."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU; torch sees none on this machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def no_rendezvous_left(monkeypatch):
    """Each test's ranks meet where they choose: a rendezvous an earlier test left in this process's environment
    (MASTER_ADDR / MASTER_PORT, inherited by every script a test starts) is removed for the test."""
    for name in ("MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture(autouse=True)
def no_process_group_left():
    """No test leaves a process group in this process (a script keeps the group of a call whose rank 0 ran in it
    until the script ends): a later test that forks ranks from this process would find it there."""
    yield
    from easyfit.distributed.strategies.parallel import destroy_process_group
    destroy_process_group()


def torch_compile_settings() -> dict:
    """torch's compiler configs (dynamo, AOTAutograd, inductor), each option read as code reads it (an option whose
    attribute was deleted reads "<deleted>"); none is imported here for the first time (importing torch._inductor
    costs seconds)."""
    import sys
    import warnings
    names = ("torch._dynamo.config", "torch._functorch.config", "torch._inductor.config")
    configs = {name: sys.modules[name] for name in names if name in sys.modules}
    with warnings.catch_warnings():   # reading a deprecated option warns
        warnings.simplefilter("ignore")
        return {name: {option: getattr(config, option, "<deleted>") for option in config.get_config_copy()}
                for name, config in configs.items()}


@pytest.fixture(autouse=True, scope="module")
def compile_settings_unchanged(request):
    """No test module leaves torch's compiler settings changed: a change made without torch's own `config.patch`
    (a monkeypatch, an assignment) leaks into every later test, or, undone by deleting the attribute, breaks them."""
    before = torch_compile_settings()
    yield
    after = torch_compile_settings()
    changed = sorted(f"{config}.{option}" for config, options in before.items()
                     for option, value in options.items() if after[config].get(option, "<deleted>") != value)
    assert not changed, f"{request.module.__name__} left torch's compiler settings changed: {', '.join(changed)}"
