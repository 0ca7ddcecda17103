"""EMA and SWA against the same averages computed by hand on plain PyTorch (within 1e-6), in one process and on 2 CPU
processes (EMA under ddp, fsdp, tp and DeepSpeed ZeRO-3; SWA under ddp): validation runs the averages, the net holds
them after the fit, checkpoints (loaded as data) hold both sets and a resume continues exactly."""
from __future__ import annotations

import importlib.util
import os

import pytest
import torch
from around_helpers import hand_ema, hand_swa, make_data, make_net, max_difference, run_around_each
from torch import nn
from torch.optim.swa_utils import SWALR, update_bn

import easyfit
from easyfit.callbacks import EMA, SWA, ModelCheckpoint
from easyfit.saving.checkpoint import FSDP_META_FILE

LR = 0.1
HAVE_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None
#: the sharding strategies whose EMA one launch checks, in turn
SHARDED = ["fsdp", "fsdp_sharded", "tp", *(["deepspeed_stage_3"] if HAVE_DEEPSPEED else [])]


def model_for(net=None, **kwargs) -> easyfit.Model:
    net = net or make_net()
    return easyfit.Model(net, "cross_entropy", torch.optim.SGD(net.parameters(), lr=LR), **kwargs)


def fit(model, epochs, callbacks, **options):
    x, y = make_data()
    return model.fit(x, y, batch_size=32, epochs=epochs, shuffle=False, verbose=0, validation_data=(x[:64], y[:64]),
                     callbacks=callbacks, **options)


def test_ema_equals_the_hand_computation_and_validation_runs_the_averages():
    model = model_for()
    history = fit(model, 3, [EMA(0.9)])
    averaged, losses = hand_ema(3, 0.9)
    assert max_difference(model.net.state_dict(), averaged) <= 1e-6   # the net holds the averages after the fit
    assert history.history["val_loss"] == pytest.approx(losses, abs=1e-6)
    x, y = make_data()
    assert model.evaluate(x[:64], y[:64], verbose=0) == pytest.approx(losses[-1], abs=1e-6)


def test_ema_every_n_steps_counts_optimizer_steps_through_accumulation():
    model = model_for()
    x, y = make_data()
    model.fit(x, y, batch_size=16, gradient_accumulation_steps=2, epochs=2, shuffle=False, verbose=0,
              lr_scaling=None, callbacks=[EMA(0.8, every_n_steps=3)])
    averaged, _ = hand_ema(2, 0.8, every=3)
    assert max_difference(model.net.state_dict(), averaged) <= 1e-6


def test_checkpoints_hold_both_sets_and_a_resume_continues_exactly(tmp_path):
    pattern = str(tmp_path / "epoch{epoch}.pt")
    fit(model_for(), 2, [EMA(0.9), ModelCheckpoint(pattern, monitor="loss")])
    saved = torch.load(pattern.format(epoch=2), weights_only=True)
    averaged, _ = hand_ema(2, 0.9)
    assert max_difference(saved["callbacks"]["EMA"]["averaged"], averaged) <= 1e-6
    assert max_difference(saved["net"], averaged) > 1e-3   # the training weights, not the averages
    resumed = model_for()
    fit(resumed, 4, [EMA(0.9)], resume_from=pattern.format(epoch=2))
    assert max_difference(resumed.net.state_dict(), hand_ema(4, 0.9)[0]) <= 1e-6


def test_a_checkpoint_saved_after_the_fit_resumes_from_the_training_weights(tmp_path):
    model = model_for()
    fit(model, 2, [EMA(0.9)])
    model.save(tmp_path / "after.pt")
    state = torch.load(tmp_path / "after.pt", weights_only=True)
    assert max_difference(state["net"], hand_ema(2, 0.9)[0]) <= 1e-6   # after the fit the net is the average
    resumed = model_for()
    fit(resumed, 3, [EMA(0.9)], resume_from=tmp_path / "after.pt")
    assert max_difference(resumed.net.state_dict(), hand_ema(3, 0.9)[0]) <= 1e-6


def test_a_new_fit_with_the_same_callback_starts_a_new_average():
    ema, model = EMA(0.9), model_for()
    fit(model, 1, [ema])
    first = {key: value.clone() for key, value in model.net.state_dict().items()}
    fit(model, 1, [ema])
    assert max_difference(model.net.state_dict(), first) > 1e-4


def bn_net() -> nn.Module:
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 3))


def test_swa_equals_swalr_and_update_bn_by_hand():
    """From epoch 1, SWALR anneals to swa_lr over 2 epochs; the weights after epochs 1..3 are averaged, then BatchNorm's
    statistics recomputed for the average over the training data."""
    x, y = make_data()
    model = model_for(bn_net())
    history = model.fit(x, y, batch_size=32, epochs=4, shuffle=False, verbose=0, lr_scaling=None,
                        callbacks=[SWA(swa_lr=0.02, start_epoch=1, annealing_epochs=2)])
    net = bn_net()
    optimizer = torch.optim.SGD(net.parameters(), lr=LR)
    averaged, count, scheduler, lrs = None, 0, None, []
    for epoch in range(4):
        if epoch >= 1 and scheduler is None:
            scheduler = SWALR(optimizer, swa_lr=0.02, anneal_epochs=2, anneal_strategy="cos")
        lrs.append(optimizer.param_groups[0]["lr"])
        for start in range(0, len(x), 32):
            loss = torch.nn.functional.cross_entropy(net(x[start:start + 32]), y[start:start + 32])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        if epoch >= 1:
            current = [p.detach().clone() for p in net.parameters()]
            averaged = current if averaged is None else [a + (c - a) / (count + 1) for a, c in zip(averaged, current)]
            count += 1
            scheduler.step()
    for param, value in zip(net.parameters(), averaged):
        param.data.copy_(value)
    update_bn([x[start:start + 32] for start in range(0, len(x), 32)], net)
    assert max_difference(model.net.state_dict(), net.state_dict()) <= 1e-6
    assert lrs[1] == pytest.approx(LR) and lrs[2] != pytest.approx(LR)   # annealing started after epoch 2 began
    assert len(history.history["loss"]) == 4


def test_bad_arguments_are_named_before_training():
    with pytest.raises(ValueError, match="decay must be a number in"):
        EMA(decay=1.5)
    with pytest.raises(ValueError, match="every_n_steps"):
        EMA(every_n_steps=0)
    with pytest.raises(ValueError, match="swa_lr"):
        SWA(swa_lr=-1)
    with pytest.raises(ValueError, match="annealing_strategy"):
        SWA(swa_lr=0.1, annealing_strategy="exp")
    net = make_net()
    model = easyfit.Model(net, "cross_entropy", torch.optim.SGD(net.parameters(), lr=LR),
                          scheduler=lambda optimizer: torch.optim.lr_scheduler.StepLR(optimizer, 1))
    with pytest.raises(ValueError, match="SWA sets the learning rate"):
        fit(model, 1, [SWA(swa_lr=0.05)])


def check_averaged_run(results: list[dict], checkpoint_file: str = "") -> None:
    """Each rank's net holds the hand-computed averages after the fit; validation ran them; the resume from epoch 2
    ends with the same averages; the checkpoint (or `checkpoint_file` in its directory) loads as data and holds the
    whole averages."""
    assert len(results) == 2, f"{len(results)} results: one a rank expected"
    averaged, losses = hand_ema(3, 0.9)
    for result in results:
        assert max_difference(result["averaged"], averaged) <= 1e-6
        assert max_difference(result["resumed"], averaged) <= 1e-6
        assert result["history"]["val_loss"] == pytest.approx(losses, abs=1e-6)
    path = results[0]["checkpoint"]
    saved = torch.load(os.path.join(path, checkpoint_file) if checkpoint_file else path, weights_only=True)
    assert max_difference(saved["callbacks"]["EMA"]["averaged"], hand_ema(2, 0.9)[0]) <= 1e-6


@pytest.mark.timeout(600)
def test_ema_under_ddp_on_two_processes(ddp_around):
    check_averaged_run(ddp_around["ema"])


@pytest.fixture(scope="module")
def sharded_ema(tmp_path_factory) -> dict:
    """EMA under each of SHARDED, one 2-process launch (starting processes is what costs time)."""
    return run_around_each(tmp_path_factory.mktemp("around-sharded"), SHARDED, ["ema"], timeout=550)


@pytest.mark.timeout(600)
def test_ema_under_fsdp_averages_each_shard_and_hands_back_the_full_average(sharded_ema):
    check_averaged_run(sharded_ema["fsdp"]["ema"])


@pytest.mark.timeout(600)
def test_ema_under_fsdp_with_sharded_checkpoints_saves_and_resumes_the_whole_average(sharded_ema):
    """FSDP(state_dict_type="sharded") checkpoints are torch.distributed.checkpoint directories; EMA's averages go
    into their metadata file whole (each rank's shard gathered), and the resume cuts them again."""
    check_averaged_run(sharded_ema["fsdp_sharded"]["ema"], FSDP_META_FILE)


@pytest.mark.timeout(600)
def test_ema_under_tensor_parallel_averages_each_shard_and_hands_back_the_full_average(sharded_ema):
    """strategy="tp": the averages are DTensors split as the weights are; the checkpoint holds them whole."""
    check_averaged_run(sharded_ema["tp"]["ema"])


@pytest.mark.timeout(600)
@pytest.mark.skipif(not HAVE_DEEPSPEED, reason="pip install easyfit[deepspeed]")
def test_ema_under_deepspeed_zero3_averages_each_ranks_fp32_partition(sharded_ema):
    check_averaged_run(sharded_ema["deepspeed_stage_3"]["ema"])


@pytest.mark.timeout(600)
def test_swa_under_ddp_on_two_processes(ddp_around):
    expected = hand_swa(epochs=3, swa_lr=0.02, start_epoch=1, annealing_epochs=1)
    for result in ddp_around["swa"]:
        assert max_difference(result["averaged"], expected) <= 1e-6


def test_ema_refuses_several_steps_per_compiled_call_before_any_work():
    """EMA averages after every optimizer step; its hooks would see every 4th: a silently different average."""
    net = torch.nn.Linear(4, 2)
    model = easyfit.Model(net, "cross_entropy", "sgd", lr=0.1)
    before = [p.detach().clone() for p in net.parameters()]
    with pytest.raises(ValueError, match="EMA must see every optimizer step.*steps_per_execution=4"):
        model.fit(torch.randn(32, 4), torch.randint(0, 2, (32,)), batch_size=4, compile=True, steps_per_execution=4,
                  callbacks=[easyfit.callbacks.EMA()], verbose=0)
    assert all(torch.equal(a, b) for a, b in zip(before, net.parameters()))
