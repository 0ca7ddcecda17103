"""A strategy object is configuration; what one fit holds is its `Fit`, which the strategy's `setup` returns, the
Model reads while the fit runs (`model._training`) and drops at the fit's end, and which is never pickled with the
strategy. A strategy written to the earlier contract is refused saying what changed. In-process fits only (one
process), so every case is fast."""
from __future__ import annotations

import os
import pickle
import re

import pytest
import torch

import easyfit
from easyfit.distributed import calls
from easyfit.distributed.connector import connect
from easyfit.distributed.strategies.base import Strategy
from easyfit.distributed.strategies.ddp import DDPFit, DDPStrategy
from easyfit.distributed.strategies.single import SingleDeviceStrategy
from easyfit.distributed.strategies.states import Fit

pytestmark = pytest.mark.timeout(60)
LAUNCHER_VARIABLE = re.compile(r"(SLURM|OMPI|PMI|HOROVOD|TORCHELASTIC|EASYFIT)_|(MASTER_ADDR|MASTER_PORT|WORLD_SIZE|"
                               r"RANK|LOCAL_RANK|NODE_RANK|GROUP_RANK|LOCAL_WORLD_SIZE)$")


@pytest.fixture(autouse=True)
def plain_script(monkeypatch):
    """A plain `python script.py`, whatever runs the tests."""
    for name in [name for name in os.environ if LAUNCHER_VARIABLE.match(name)]:
        monkeypatch.delenv(name)
    monkeypatch.setattr(calls, "is_interactive", lambda: False)


class SeesFit(easyfit.callbacks.Callback):
    """Records the running fit's object at every training batch's end."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def on_train_batch_end(self, batch, logs=None):
        self.seen.append(self.model._training)


def data() -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(32, 4, generator=torch.Generator().manual_seed(0))
    return x, (x[:, 0] > 0).long()


def fitted(strategy, make_net) -> tuple[easyfit.Model, SeesFit]:
    model, sees = easyfit.Model(make_net(out_features=2), "cross_entropy", "sgd", lr=0.1), SeesFit()
    model.fit(*data(), epochs=1, batch_size=16, verbose=0, devices=1, accelerator="cpu", callbacks=[sees],
              strategy=strategy)
    return model, sees


@pytest.mark.parametrize("strategy", [Strategy(), SingleDeviceStrategy()], ids=["base", "single"])
def test_a_strategy_pickles_without_its_launcher(strategy):
    assert strategy.make_launcher() is None and not hasattr(strategy, "fit_state")
    copy = pickle.loads(pickle.dumps(strategy))
    assert "_launcher" not in vars(copy) and copy.root_device == strategy.root_device


def test_a_configured_ddp_strategy_pickles_its_configuration_only():
    strategy = connect(DDPStrategy(start_method="spawn", find_unused_parameters=True), devices=2, accelerator="cpu")
    assert strategy.make_launcher() is not None
    copy = pickle.loads(pickle.dumps(strategy))
    assert "_launcher" not in vars(copy)
    assert (copy.parallel_devices, copy.process_group_backend, copy.wrapping.find_unused_parameters) == \
        ([torch.device("cpu")] * 2, "gloo", True)


def test_single_trains_a_plain_fit_of_the_models_own_objects(make_net):
    model, sees = fitted("single", make_net)
    assert len(sees.seen) == 2 and sees.seen[0] is sees.seen[1] and type(sees.seen[0]) is Fit
    assert sees.seen[0].net is model.net and sees.seen[0].optimizer is model._optimizer
    assert model._training is None


def test_a_ddp_fit_holds_its_wrapper_until_it_ends(make_net):
    model, sees = fitted(DDPStrategy(), make_net)
    assert len(sees.seen) == 2 and all(isinstance(fit, DDPFit) for fit in sees.seen)
    assert sees.seen[0] is sees.seen[1] and isinstance(sees.seen[0].net, torch.nn.parallel.DistributedDataParallel)
    assert sees.seen[0].net.module is model.net and sees.seen[0].hook_state is None
    assert model._training is None


def test_a_strategy_written_to_the_earlier_step_contract_is_refused_saying_what_changed():
    with pytest.raises(TypeError, match=r"OldStep defines backward, no_sync as the earlier Strategy contract did.*"
                                        r"take that fit first.*backward\(self, fit, loss, precision\)"):
        class OldStep(SingleDeviceStrategy):
            def backward(self, loss, precision):
                precision.backward(loss)

            def no_sync(self, net):
                return net.no_sync()
    with pytest.raises(TypeError, match=r"OldSetup defines setup as.*setup\(net, optimizer, scheduler=None, "
                                        r"settings=None, call=None\)` returns the fit's object"):
        class OldSetup(SingleDeviceStrategy):
            def setup(self, net, optimizer, scheduler=None):
                return net, optimizer, scheduler
    with pytest.raises(ImportError, match="FitState is now easyfit.strategies.Fit"):
        from easyfit.strategies import FitState  # noqa: F401


def test_a_setup_that_returns_no_fit_is_refused_before_training(make_net):
    class TupleSetup(SingleDeviceStrategy):
        def setup(self, net, optimizer, scheduler=None, settings=None, call=None):
            return net, optimizer, scheduler

    model = easyfit.Model(make_net(out_features=2), "cross_entropy", "sgd", lr=0.1)
    before = [p.detach().clone() for p in model.net.parameters()]
    with pytest.raises(TypeError, match=r"TupleSetup.setup returned tuple, not the fit's object.*easyfit.strategies"
                                        r".Fit"):
        model.fit(*data(), epochs=1, batch_size=16, verbose=0, strategy=TupleSetup())
    assert all(torch.equal(b, p) for b, p in zip(before, model.net.parameters()))
