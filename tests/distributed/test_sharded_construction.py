"""Nets built sharded from the start (`strategy.module_construction()`): FSDP2 on the meta device, DeepSpeed ZeRO-3
under `zero.Init`. Each launch (tests/distributed/scripts/construction.py, 2 CPU processes, gloo) checks the memory
right after construction, parity with the same net built whole, the weights handed back, and the errors of a net that
got none; one launch per strategy, started by easyfit.launch or by torchrun. DeepSpeed ZeRO-3 runs under both: the
torchrun launch checks what a launcher can change (construction, parity, the weights handed back), the other one
everything."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
import torch
from runner import SCRIPTS, make_data, make_net
from torch import nn

import easyfit
from easyfit.distributed.environments import LocalEnvironment
from easyfit.distributed.strategy_parts.meta_init import (
    construction_rng,
    initialize,
    materialize,
    materialize_sharded,
    on_meta_device,
    post_order,
)

pytestmark = pytest.mark.timeout(300)

NEEDS_DEEPSPEED = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                                     reason="pip install easyfit[deepspeed]")
NO_WEIGHTS = "the net holds no full weights"


def run(tmp_path, strategy: str, torchrun: bool, *options: str) -> list[dict]:
    torchrun_options = ["--nproc_per_node", "2", "--log-dir", str(tmp_path / "torchrun-logs")]   # not in /tmp
    command = [sys.executable, *(["-m", "torch.distributed.run", *torchrun_options] if torchrun else []),
               str(SCRIPTS / "construction.py"), str(tmp_path), strategy, *options]
    process = subprocess.run(command, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                             timeout=240, stdin=subprocess.DEVNULL)
    assert process.returncode == 0, process.stderr[-6000:]
    return [torch.load(tmp_path / f"{rank}.pt", weights_only=False) for rank in (0, 1)]


def check(tmp_path, strategy: str, ranks: list[dict], held_ratio: float) -> None:
    x, y = make_data()
    for rank, found in enumerate(ranks):
        held, full = found["memory"]
        print(f"{strategy} rank {rank}: holds {held} of {full} parameter bytes after construction "
              f"({held / full:.2f}); built sharded vs whole after fit: max difference {found['difference']:.1e}")
        assert held <= held_ratio * full, f"rank {rank} holds {held} of {full} bytes right after construction"
        assert found["difference"] <= 1e-6, "the net built sharded trains differently from the net built whole"
        assert found["val_loss"][0] == pytest.approx(found["val_loss"][1], abs=1e-6)
        assert found["plain"], "after fit the net built sharded is not a plain module"
        for action in ("save", "evaluate") if "errors" in found else ():   # hand_back=False: the net got no weights
            assert NO_WEIGHTS in found["errors"][action] and "hand_back=True" in found["errors"][action]
        if "lockstep" in found:   # hand_back=False: validation ran the sharded net in step, nothing gathered
            print(f"rank {rank}, hand_back=False with uneven validation shares: gathered "
                  f"{found['lockstep']['gathers']} times")
            assert found["lockstep"]["gathers"] == 0
            for size in (5, 1):
                losses = found["lockstep"]["val_loss"]
                assert losses["kept", size] == pytest.approx(losses["handed_back", size], abs=1e-6)
        if "refit" in found.get("errors", {}):
            assert "still the module of the DeepSpeed engine" in found["errors"]["refit"]
            print(f"bf16-mixed, built in fp32 vs built whole: max difference {found['bf16_difference']:.1e}")
            assert found["bf16_difference"] <= 1e-6
            print(f"another fit after the hand-back: first loss {found['refit_loss']:.3f} "
                  f"(from the initial weights: {found['fresh_loss']:.3f})")
            assert found["refit_loss"] < 0.8 * found["fresh_loss"], "the net handed back does not train on"
    restored = easyfit.Model.load(tmp_path / "saved.pt", net=make_net())   # one process, a plain net
    torch.testing.assert_close(restored.predict(x), ranks[0]["predictions"], rtol=0, atol=0)
    torch.testing.assert_close(ranks[1]["predictions"], ranks[0]["predictions"], rtol=0, atol=0)
    last = easyfit.Model.load(tmp_path / "epoch3.pt", net=make_net())   # ModelCheckpoint inside the fit
    torch.testing.assert_close(last.predict(x), ranks[0]["predictions"], rtol=0, atol=0)
    expected = restored.evaluate(x, y, batch_size=8, verbose=0, return_dict=True)
    assert all(found["scores"]["loss"] == pytest.approx(expected["loss"], abs=1e-6) for found in ranks)


def test_fsdp_builds_on_the_meta_device_after_easyfit_launch(tmp_path):
    check(tmp_path, "fsdp", run(tmp_path, "fsdp", torchrun=False), held_ratio=0)


def test_fsdp_cpu_offload_builds_on_the_meta_device_under_torchrun(tmp_path):
    check(tmp_path, "fsdp_cpu_offload", run(tmp_path, "fsdp_cpu_offload", torchrun=True), held_ratio=0)


@NEEDS_DEEPSPEED
def test_deepspeed_stage_3_builds_partitioned_after_easyfit_launch(tmp_path):
    check(tmp_path, "deepspeed_stage_3", run(tmp_path, "deepspeed_stage_3", torchrun=False), held_ratio=0.55)


@NEEDS_DEEPSPEED
def test_deepspeed_stage_3_builds_partitioned_under_torchrun(tmp_path):
    check(tmp_path, "deepspeed_stage_3", run(tmp_path, "deepspeed_stage_3", True, "--built-only"), held_ratio=0.55)


# ---------------------------------------------------------------- in this process
class Scale(nn.Module):
    """Holds a parameter but has no reset_parameters()."""

    def __init__(self):
        super().__init__()
        self.factor = nn.Parameter(torch.ones(3))

    def forward(self, x):
        return x * self.factor


def test_a_strategy_that_does_not_know_its_ranks_says_to_launch_them_first(monkeypatch):
    monkeypatch.setattr("easyfit.distributed.environments.detect_environment", LocalEnvironment)   # no launcher
    with pytest.raises(ValueError, match=r"does not know its ranks yet.*easyfit.launch\(strategy=.*torchrun"):
        easyfit.strategies.DeepSpeed(stage=3).module_construction()


def test_stages_1_and_2_build_the_net_as_usual():
    with easyfit.strategies.DeepSpeed(stage=2).module_construction():
        net = make_net()
    assert not any(p.is_meta or hasattr(p, "ds_id") for p in net.parameters())


def test_a_module_without_reset_parameters_is_named_at_construction_and_at_materialization():
    with pytest.raises(ValueError, match=r"Scale hold\(s\) parameters or buffers but has no reset_parameters"):
        with easyfit.strategies.FSDP().module_construction():
            nn.Sequential(nn.Linear(6, 3), Scale())
    with torch.device("meta"):   # built on the meta device by other means: found when it is materialized
        net = nn.Sequential(nn.Linear(6, 3), Scale())
    with pytest.raises(ValueError, match=r"1 \(Scale\) hold\(s\) parameters"):
        materialize(net)


def ordinary_net() -> nn.Module:
    return nn.Sequential(nn.Embedding(10, 8), nn.TransformerEncoderLayer(8, 2, dim_feedforward=16), nn.Linear(8, 8),
                         nn.ReLU(), nn.LayerNorm(8), nn.Conv1d(8, 3, 1), nn.BatchNorm1d(3))


def test_materialized_on_the_cpu_the_net_equals_the_net_built_whole_and_keeps_its_parameter_objects():
    """Ordinary layers, attention (its _reset_parameters) included: the same draws in the same order."""
    torch.manual_seed(3)
    whole = ordinary_net()
    with on_meta_device():
        torch.manual_seed(3)   # a seed set inside the context counts
        net = ordinary_net()
    assert all(p.is_meta for p in net.parameters())
    before = list(net.parameters())
    with torch.random.fork_rng(devices=[]):
        torch.set_rng_state(construction_rng(net))
        initialize(post_order(net))
    assert all(a is b for a, b in zip(before, net.parameters()))
    torch.testing.assert_close(net.state_dict(), whole.state_dict(), rtol=0, atol=0)


def test_modules_built_outside_the_context_keep_their_values():
    trained = nn.Linear(6, 8)
    with on_meta_device():
        net = nn.Sequential(trained, nn.Tanh(), nn.Linear(8, 3))
    kept = trained.weight.detach().clone()
    materialize(net)
    assert torch.equal(net[0].weight, kept) and not net[2].weight.is_meta


def test_the_net_is_materialized_one_shard_unit_at_a_time():
    """The full bytes the net holds while it is materialized never exceed one unit's (here, shard = freeing)."""
    with on_meta_device():
        net = nn.Sequential(nn.Linear(64, 256), nn.Tanh(), nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 8))
    units = [net[0], net[2], net[4]]
    held = []

    def shard(unit: nn.Module) -> None:
        held.append(sum(p.numel() * p.element_size() for p in net.parameters() if not p.is_meta))
        unit.to("meta")   # what sharding does to the full tensors: this rank keeps only a slice

    materialize_sharded(net, units, shard, torch.get_rng_state())
    largest = max(sum(p.numel() * p.element_size() for p in unit.parameters()) for unit in units)
    total = sum(p.numel() * p.element_size() for p in net.parameters())
    print(f"full bytes held while materializing: at most {max(held)} of {total} (largest unit {largest})")
    assert held[:3] == [64 * 256 * 4 + 256 * 4, 256 * 256 * 4 + 256 * 4, 256 * 8 * 4 + 8 * 4]
    assert max(held) == largest


def test_a_meta_net_fits_only_under_fsdp_and_loads_a_saved_state(tmp_path):
    with easyfit.strategies.FSDP().module_construction():
        net = make_net()
    model = easyfit.Model(net, "cross_entropy", "adam")
    x, y = make_data()
    with pytest.raises(ValueError, match=r"built under module_construction\(\) of strategy 'fsdp'.*meta device"):
        model.fit(x, y, epochs=1, verbose=0, strategy="single")
    with pytest.raises(ValueError, match=NO_WEIGHTS):
        model.predict(x)
    trained = easyfit.Model(make_net(), "cross_entropy", "adam")
    trained.save(tmp_path / "plain.pt")
    restored = easyfit.Model.load(tmp_path / "plain.pt", net=net)   # a meta net is materialized to take it
    torch.testing.assert_close(restored.predict(x), trained.predict(x), rtol=0, atol=0)


@pytest.mark.parametrize("option", [{"comm_hook": "fp16"}, {"model_averaging_period": 4}])
def test_fsdp_refuses_ddp_gradient_communication_it_would_ignore(option):
    from easyfit.distributed.strategies.fsdp import FSDPStrategy
    with pytest.raises(ValueError, match=rf"FSDPStrategy does not take {next(iter(option))}: DDP's gradient"):
        FSDPStrategy(**option)
