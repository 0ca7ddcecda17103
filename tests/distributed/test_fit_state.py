"""A strategy object is configuration; what one fit holds is its `fit_state`, made by `setup`, dropped at the fit's
end and never pickled. In-process fits only (one process), so every case is fast."""
from __future__ import annotations

import os
import pickle
import re
import threading

import pytest
import torch

import easyfit
from easyfit.distributed import calls
from easyfit.distributed.connector import connect
from easyfit.distributed.strategies.base import FitState, Strategy
from easyfit.distributed.strategies.ddp import DDPFit, DDPStrategy
from easyfit.distributed.strategies.single import SingleDeviceStrategy

pytestmark = pytest.mark.timeout(60)
LAUNCHER_VARIABLE = re.compile(r"(SLURM|OMPI|PMI|HOROVOD|TORCHELASTIC|EASYFIT)_|(MASTER_ADDR|MASTER_PORT|WORLD_SIZE|"
                               r"RANK|LOCAL_RANK|NODE_RANK|GROUP_RANK|LOCAL_WORLD_SIZE)$")


@pytest.fixture(autouse=True)
def plain_script(monkeypatch):
    """A plain `python script.py`, whatever runs the tests."""
    for name in [name for name in os.environ if LAUNCHER_VARIABLE.match(name)]:
        monkeypatch.delenv(name)
    monkeypatch.setattr(calls, "is_interactive", lambda: False)


class SeesFitState(easyfit.callbacks.Callback):
    """Records the strategy's fit state at every training batch's end."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def on_train_batch_end(self, batch, logs=None):
        self.seen.append(self.model.strategy.fit_state)


def data() -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(32, 4, generator=torch.Generator().manual_seed(0))
    return x, (x[:, 0] > 0).long()


def fitted(strategy, make_net) -> tuple[easyfit.Model, SeesFitState]:
    model, sees = easyfit.Model(make_net(out_features=2), "cross_entropy", "sgd", lr=0.1), SeesFitState()
    model.fit(*data(), epochs=1, batch_size=16, verbose=0, devices=1, accelerator="cpu", callbacks=[sees],
              strategy=strategy)
    return model, sees


@pytest.mark.parametrize("strategy", [Strategy(), SingleDeviceStrategy()], ids=["base", "single"])
def test_a_strategy_pickles_without_its_fit_state_and_launcher(strategy):
    assert strategy.fit_state is None and strategy.launcher is None
    strategy.fit_state = FitState()
    copy = pickle.loads(pickle.dumps(strategy))
    assert copy.fit_state is None and {"fit_state", "_launcher"}.isdisjoint(vars(copy))
    assert copy.root_device == strategy.root_device


def test_a_configured_ddp_strategy_pickles_its_configuration_only():
    strategy = connect(DDPStrategy(start_method="spawn", find_unused_parameters=True), devices=2, accelerator="cpu")
    assert strategy.launcher is not None and strategy.fit_state is None
    strategy.fit_state = DDPFit(wrapped=threading.Lock(), hook_state=None)   # what a fit holds need not pickle
    copy = pickle.loads(pickle.dumps(strategy))
    assert copy.fit_state is None and {"fit_state", "_launcher"}.isdisjoint(vars(copy))
    assert (copy.parallel_devices, copy.process_group_backend, copy.wrapping.find_unused_parameters) == \
        ([torch.device("cpu")] * 2, "gloo", True)


def test_single_keeps_no_fit_state(make_net):
    model, sees = fitted("single", make_net)
    assert sees.seen == [None, None] and model.strategy.fit_state is None


def test_a_ddp_fit_holds_its_wrapper_in_the_fit_state_until_it_ends(make_net):
    model, sees = fitted(DDPStrategy(), make_net)
    assert len(sees.seen) == 2 and all(isinstance(state, DDPFit) for state in sees.seen)
    assert sees.seen[0] is sees.seen[1] and isinstance(sees.seen[0].wrapped, torch.nn.parallel.DistributedDataParallel)
    assert sees.seen[0].hook_state is None
    assert model.strategy.fit_state is None
