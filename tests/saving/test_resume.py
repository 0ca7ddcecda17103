"""Resuming from a checkpoint gives the weights of an uninterrupted run; save / load round trips."""
from __future__ import annotations

import pytest
import torch

import easyfit


def model_with_scheduler(make_net) -> easyfit.Model:
    """Adam + StepLR over a net with dropout: resuming must restore optimizer, scheduler and RNG state."""
    net = make_net(dropout=0.3)

    def scheduler(optimizer):
        return torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)
    return easyfit.Model(net, "cross_entropy", "adam", metrics=["accuracy"], lr=0.01, scheduler=scheduler)


def fit(model: easyfit.Model, data, epochs: int, **kwargs):
    return model.fit(*data, epochs=epochs, batch_size=16, shuffle=True, seed=5, verbose=0, **kwargs)


def test_fit_4_save_resume_to_8_equals_8_straight(make_net, classification, tmp_path):
    path = tmp_path / "after4.pt"
    first, resumed, straight = (model_with_scheduler(make_net) for _ in range(3))
    torch.manual_seed(11)
    fit(first, classification, 4)
    first.save(path)
    torch.manual_seed(12)   # the resumed run must not depend on the RNG state it starts from
    history = fit(resumed, classification, 8, resume_from=path)
    torch.manual_seed(11)
    expected = fit(straight, classification, 8)
    torch.testing.assert_close(resumed.net.state_dict(), straight.net.state_dict(), atol=1e-6, rtol=0)
    assert history.epoch == list(range(8)) and len(history.history["loss"]) == 8
    assert history.history["loss"] == pytest.approx(expected.history["loss"], abs=1e-6)
    assert resumed.optimizer.param_groups[0]["lr"] == pytest.approx(straight.optimizer.param_groups[0]["lr"])


def test_save_and_load_round_trip(make_net, classification, tmp_path):
    path = tmp_path / "model.pt"
    model = easyfit.Model(make_net(), "cross_entropy", "adamw", metrics=["accuracy"], lr=0.02)
    model.fit(*classification, epochs=2, verbose=0)
    model.save(path)
    loaded = easyfit.Model.load(path, net=make_net(seed=99))
    torch.testing.assert_close(loaded.net.state_dict(), model.net.state_dict(), atol=0, rtol=0)
    assert isinstance(loaded.optimizer, torch.optim.AdamW)
    assert loaded.optimizer.param_groups[0]["lr"] == 0.02
    torch.testing.assert_close(loaded.optimizer.state_dict()["state"], model.optimizer.state_dict()["state"])
    assert loaded.history.history == model.history.history and loaded.history.epoch == [0, 1]
    assert loaded.evaluate(*classification, verbose=0) == pytest.approx(model.evaluate(*classification, verbose=0))


def test_load_rebuilds_an_optimizer_instance_and_named_metrics(make_net, classification, tmp_path):
    path = tmp_path / "model.pt"
    net = make_net()
    model = easyfit.Model(net, optimizer=torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9),
                          metrics={"acc": "accuracy", "top": "top3_accuracy"})
    model.fit(*classification, epochs=1, verbose=0)
    model.save(path)
    loaded = easyfit.Model.load(path, net=make_net())
    assert isinstance(loaded.optimizer, torch.optim.SGD) and loaded.optimizer.param_groups[0]["momentum"] == 0.9
    assert loaded.evaluate(*classification, verbose=0) == pytest.approx(model.evaluate(*classification, verbose=0))
    loaded.fit(*classification, epochs=1, verbose=0)


def test_checkpoints_get_ordinary_file_permissions(tmp_path, make_net):
    import os
    mask = os.umask(0o022)
    try:
        easyfit.Model(make_net()).save(tmp_path / "run.pt")
    finally:
        os.umask(mask)
    assert os.stat(tmp_path / "run.pt").st_mode & 0o777 == 0o644
