"""strategy="bagua": the dispatcher, the option checks and the error without Bagua, for real; Bagua's API through
contract tests.

Bagua cannot be installed here (its last release needs CUDA <= 11.x with NCCL and Python <= 3.9), so the tests named
`test_contract_*` stand a FAKE `bagua.torch_api` in for the real one: they check that easyfit calls Bagua's API as
Bagua 0.9 documents it (init_process_group, with_bagua, the algorithm classes and options, QAdamOptimizer,
abort/resume of the asynchronous algorithm), not that Bagua trains. The real test at the end skips without Bagua
and CUDA.
"""
from __future__ import annotations

import os
import sys
import types
from types import SimpleNamespace

import pytest
import torch

from easyfit.distributed import calls
from easyfit.distributed.connector import connect
from easyfit.distributed.strategies.bagua import ALGORITHMS, DDP_IMPORT, BaguaStrategy

EQUIVALENTS = {"gradient_allreduce": "DDPStrategy()", "bytegrad": "DDPStrategy(comm_hook='fp16')",
               "decentralized": "DDPStrategy(model_averaging_period=4)",
               "low_precision_decentralized": "DDPStrategy(model_averaging_period=4)",
               "async": "DDPStrategy(model_averaging_period=4)", "qadam": "DDPStrategy(comm_hook='powersgd')"}


@pytest.fixture(autouse=True)
def plain_script(monkeypatch):
    for name in [name for name in os.environ if name.startswith(("BAGUA_", "HOROVOD_", "OMPI_", "SLURM_", "EASYFIT_"))
                 or name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_RUN_ID", "GROUP_RANK")]:
        monkeypatch.delenv(name)
    monkeypatch.setattr(calls, "is_interactive", lambda: False)


@pytest.fixture
def no_bagua(monkeypatch):
    monkeypatch.setitem(sys.modules, "bagua", None)   # `import bagua.torch_api` raises ImportError


# ------------------------------------------------------------------ without Bagua (real)
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_without_bagua_the_error_explains_and_names_the_torch_equivalent(algorithm, no_bagua):
    with pytest.raises(ImportError) as error:
        BaguaStrategy(algorithm)
    message = str(error.value)
    assert "0.9.2" in message and "CUDA <= 11.x" in message and "Python <= 3.9" in message
    assert EQUIVALENTS[algorithm] in message
    assert "docs/bagua.md" in message


def test_strategy_name_bagua_raises_the_explanation_before_any_process_starts(no_bagua):
    with pytest.raises(ImportError, match=r"equivalent of Bagua's 'gradient_allreduce' .* is DDPStrategy\(\)"):
        connect("bagua", devices=2, accelerator="cpu")


def test_unknown_algorithm_and_foreign_options_are_refused_first(no_bagua):
    with pytest.raises(ValueError, match="Bagua algorithm must be one of gradient_allreduce, bytegrad"):
        BaguaStrategy("one_bit_adam")
    with pytest.raises(ValueError, match=r"'bytegrad' algorithm takes hierarchical, average; received "
                                         r"sync_interval_ms"):
        BaguaStrategy("bytegrad", sync_interval_ms=100)


def test_every_equivalent_is_a_real_ddp_option():
    """The strategies the error message recommends can be built as written, after the import it names."""
    from easyfit.distributed.strategies.ddp import DDPStrategy
    names = {}
    exec(DDP_IMPORT, names)
    for spec in ALGORITHMS.values():
        assert isinstance(eval(spec.equivalent, names), DDPStrategy)


# ------------------------------------------------------------------ contract tests: a FAKE bagua
class FakeAlgorithm:
    """Stands in for each Bagua algorithm class: records the options it was built with."""

    def __init__(self, *args, **options):
        self.args, self.options = args, options


class FakeImpl:
    def __init__(self):
        self.calls = []

    def abort(self, module):
        self.calls.append("abort")

    def resume(self, module):
        self.calls.append("resume")


@pytest.fixture
def fake_bagua(monkeypatch):
    """A FAKE `bagua.torch_api` with Bagua 0.9's names; it records what easyfit calls."""
    record = SimpleNamespace(init=None, with_bagua=[])
    package, api = types.ModuleType("bagua"), types.ModuleType("bagua.torch_api")
    api.init_process_group = lambda store, rank, world_size, local_world_size: setattr(
        record, "init", (type(store).__name__, rank, world_size, local_world_size))
    api.communication = SimpleNamespace(is_initialized=lambda: record.init is not None)
    package.torch_api = api
    modules = {"bagua": package, "bagua.torch_api": api}
    for spec in ALGORITHMS.values():
        module = modules.setdefault(f"bagua.torch_api.algorithms.{spec.module}",
                                    types.ModuleType(f"bagua.torch_api.algorithms.{spec.module}"))
        setattr(module, spec.cls, type(spec.cls, (FakeAlgorithm,), {}))
    q_adam = modules["bagua.torch_api.algorithms.q_adam"]
    q_adam.QAdamOptimizer = type("QAdamOptimizer", (torch.optim.Adam,), {})
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)

    def with_bagua(self, optimizers, algorithm):
        record.with_bagua.append((optimizers, algorithm))
        self.bagua_ddp = SimpleNamespace(require_backward_grad_sync=True)
        self.bagua_algorithm = FakeImpl()
        return self
    monkeypatch.setattr(torch.nn.Module, "with_bagua", with_bagua, raising=False)
    return record


def configured(strategy: BaguaStrategy) -> BaguaStrategy:
    """Configured as the connector would, on the CPU: these tests call the strategy's methods one by one."""
    strategy.configure(accelerator="cpu", parallel_devices=[torch.device("cpu")], num_nodes=1)
    return strategy


def _net_and_adam():
    net = torch.nn.Linear(3, 2)
    return net, torch.optim.Adam(net.parameters(), lr=0.01)


@pytest.mark.parametrize("algorithm, options", [
    ("gradient_allreduce", {"hierarchical": True}), ("bytegrad", {"average": False}),
    ("decentralized", {"peer_selection_mode": "shift_one", "communication_interval": 2}),
    ("low_precision_decentralized", {"communication_interval": 3}), ("async", {"sync_interval_ms": 100}),
])
def test_contract_with_bagua_gets_the_optimizer_and_the_named_algorithm(algorithm, options, fake_bagua):
    net, optimizer = _net_and_adam()
    strategy = configured(BaguaStrategy(algorithm, **options))
    fit = strategy.setup(net, optimizer, None)
    assert fit.net is net and fit.optimizer is optimizer and fit.scheduler is None
    (optimizers, built), = fake_bagua.with_bagua
    assert optimizers == [optimizer]
    assert type(built).__name__ == ALGORITHMS[algorithm].cls and built.options == options


def test_contract_qadam_needs_bagua_qadam_optimizer(fake_bagua):
    net, adam = _net_and_adam()
    with pytest.raises(ValueError, match=r"needs the Model's optimizer to be QAdamOptimizer; received Adam"):
        configured(BaguaStrategy("qadam")).setup(net, adam)
    from bagua.torch_api.algorithms.q_adam import QAdamOptimizer
    qadam = QAdamOptimizer(net.parameters(), lr=0.05)
    configured(BaguaStrategy("qadam", hierarchical=False)).setup(net, qadam)
    (_, built), = fake_bagua.with_bagua
    assert type(built).__name__ == "QAdamAlgorithm" and built.args == (qadam,) and built.options == {
        "hierarchical": False}


def test_contract_async_averaging_pauses_for_evaluation_and_stops_after_training(fake_bagua):
    net, optimizer = _net_and_adam()
    strategy = configured(BaguaStrategy("async", sync_interval_ms=50))
    fit = strategy.setup(net, optimizer)
    assert fit.module_for_eval() is net
    fit.module_for_eval()   # a second evaluation before training resumes: aborted once only
    assert net.bagua_algorithm.calls == ["abort"]
    fit.zero_grad()   # the next training step
    assert net.bagua_algorithm.calls == ["abort", "resume"]
    fit.end(net, optimizer)
    assert net.bagua_algorithm.calls == ["abort", "resume", "abort"]


def test_contract_accumulation_micro_steps_switch_bagua_gradient_sync_off(fake_bagua):
    net, optimizer = _net_and_adam()
    strategy = configured(BaguaStrategy())
    fit = strategy.setup(net, optimizer)
    with fit.no_sync():
        assert net.bagua_ddp.require_backward_grad_sync is False
    assert net.bagua_ddp.require_backward_grad_sync is True


def test_contract_process_group_is_joined_through_bagua(fake_bagua, monkeypatch):
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    strategy = BaguaStrategy(parallel_devices=[torch.device("cuda", 0)], accelerator="cuda")
    strategy.configure(accelerator="cuda", parallel_devices=[torch.device("cuda", 0)], num_nodes=1)
    monkeypatch.setenv("MASTER_PORT", "0")
    strategy.setup_environment()
    assert fake_bagua.init == ("TCPStore", 0, 1, 1)
    assert strategy.process_group_backend == "nccl"


def test_contract_cpu_calls_are_refused_with_the_torch_equivalent(fake_bagua):
    with pytest.raises(ValueError, match=r"Bagua runs on CUDA GPUs only .* DDPStrategy\(comm_hook='fp16'\)"):
        connect(BaguaStrategy("bytegrad"), devices=2, accelerator="cpu")


def test_contract_auto_under_the_bagua_launcher_is_bagua(fake_bagua, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    for name, value in {"BAGUA_SERVICE_PORT": "29501", "RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1",
                        "NODE_RANK": "0", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                        "MASTER_PORT": "29500"}.items():
        monkeypatch.setenv(name, value)
    strategy = connect("auto")
    assert isinstance(strategy, BaguaStrategy) and strategy.make_launcher() is None
    assert (strategy.world_size, strategy.global_rank, strategy.root_device) == (2, 1, torch.device("cuda", 1))


# ------------------------------------------------------------------ real Bagua
def test_real_bagua_gradient_allreduce_trains_on_a_gpu():
    pytest.importorskip("bagua.torch_api", reason="Bagua is not installed: its last release (0.9.2) needs CUDA <= "
                                                  "11.x, NCCL and Python <= 3.9")
    if not torch.cuda.is_available():
        pytest.skip("Bagua runs on CUDA GPUs only")
    import easyfit
    x = torch.randn(256, 6, generator=torch.Generator().manual_seed(0))
    y = (x[:, 0] > 0).long()
    model = easyfit.Model(torch.nn.Linear(6, 2), "cross_entropy", "sgd", lr=0.1)
    history = model.fit(x, y, epochs=3, batch_size=32, verbose=0, devices=1, accelerator="cuda",
                        strategy=BaguaStrategy("gradient_allreduce"))
    assert history.history["loss"][-1] < history.history["loss"][0]


def test_contract_a_rank_under_bagua_launcher_joins_without_easyfit_handshake(fake_bagua, monkeypatch):
    """A rank that Bagua's launcher started joins the process group through Bagua (this path once imported a
    launcher function that no longer existed), and takes no handshake of easyfit's launcher."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    for name, value in {"BAGUA_SERVICE_PORT": "29501", "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0",
                        "NODE_RANK": "0", "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                        "MASTER_PORT": "0"}.items():
        monkeypatch.setenv(name, value)
    strategy = connect(BaguaStrategy())
    assert strategy.environment.creates_processes_externally and strategy.make_launcher() is None
    strategy.setup_environment()
    assert fake_bagua.init == ("TCPStore", 0, 1, 1)
