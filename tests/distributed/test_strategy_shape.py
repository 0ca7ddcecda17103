"""The shape of the strategy classes: composition, not a tower. Every registered strategy class has at most 5 classes
in its MRO (object left out); no sharded strategy is a DDPStrategy (what they share with data parallelism is their
common base's, ParallelStrategy; ZeRO composes DDP's wrapper); each class declares its flags in one frozen
`Capabilities`, none as a loose class attribute; no class of a strategy's MRO is named a state. And a strategy of
your own written to the earlier contract, one class attribute per flag, keeps working: a single-process fit honours
its flag; a flag written as a property is refused, saying what changed."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from runner import make_data, make_net

import easyfit
from easyfit.distributed.strategies import registry
from easyfit.distributed.strategies.base import Strategy
from easyfit.distributed.strategies.capabilities import NAMES, Capabilities
from easyfit.distributed.strategies.ddp import DDPStrategy
from easyfit.distributed.strategies.single import SingleDeviceStrategy

MOST_CLASSES = 5
SHARDED = ("Zero", "FSDP", "ModelParallel", "DDPSharded", "DeepSpeed", "Pipeline")
CLASSES = {entry.public_name: entry.load() for entry in registry.BUILT_IN}


def chain(cls: type) -> list[type]:
    return [base for base in cls.__mro__ if base is not object]


@pytest.mark.parametrize("public_name", CLASSES)
def test_no_strategy_class_is_a_tower(public_name):
    cls = CLASSES[public_name]
    assert len(chain(cls)) <= MOST_CLASSES, [base.__name__ for base in chain(cls)]
    assert not any(base.__name__.endswith("State") for base in chain(cls)), "a mixin is not a state"


@pytest.mark.parametrize("public_name", SHARDED)
def test_no_sharded_strategy_is_a_ddp_strategy(public_name):
    assert DDPStrategy not in CLASSES[public_name].__mro__


@pytest.mark.parametrize("public_name", CLASSES)
def test_each_strategy_declares_its_flags_once(public_name):
    cls = CLASSES[public_name]
    assert isinstance(cls.capabilities, Capabilities)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cls.capabilities.supports_compile = True
    loose = [(base.__name__, name) for base in chain(cls)[:-1] for name in NAMES if name in vars(base)]
    assert loose == []
    assert all(getattr(cls, name) == getattr(cls.capabilities, name) for name in NAMES)


def test_a_value_of_the_options_is_the_instance_declaration():
    assert DDPStrategy().supports_compile and not DDPStrategy(comm_hook="fp16").supports_compile
    assert DDPStrategy.capabilities.supports_compile   # the class's declaration is left as it was
    assert DDPStrategy(start_method="spawn").starts_processes and not DDPStrategy().starts_processes


class OldContract(SingleDeviceStrategy):
    """A user's strategy written to the earlier contract: it clips itself, said with a class attribute."""

    name = "old_contract"
    handles_clipping = True

    def clip_gradients(self, fit, max_norm, precision):
        raise AssertionError("the loop clipped, though the strategy said it clips itself")


def test_a_strategy_written_with_class_flags_keeps_working():
    assert OldContract.capabilities == dataclasses.replace(SingleDeviceStrategy.capabilities, handles_clipping=True)
    assert "handles_clipping" not in vars(OldContract) and OldContract().handles_clipping
    x, y = make_data()
    model = easyfit.Model(make_net(), "cross_entropy", "adam")
    history = model.fit(x, y, batch_size=32, epochs=1, verbose=0, strategy=OldContract(), gradient_clip_val=0.5)
    assert torch.isfinite(torch.tensor(history.history["loss"])).all()


def test_a_flag_written_as_a_property_is_refused_saying_what_changed():
    with pytest.raises(TypeError, match=r"OwnFlag defines supports_compile as a property.*capabilities = "
                                        r"Capabilities\(\.\.\.\).*set in __init__"):
        class OwnFlag(Strategy):
            @property
            def supports_compile(self):
                return True


def test_a_strategy_of_your_own_declares_its_flags_once():
    class Declared(Strategy):
        capabilities = Capabilities(handles_accumulation=True)

        def optimizer_step(self, fit, precision):
            precision.optimizer_step(fit.optimizer)

    assert Declared().handles_accumulation and not Declared.plain_optimizer_step   # its own step: not compiled past
