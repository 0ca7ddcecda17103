"""The last Keras habits: `model.compile(optimizer=, loss=, metrics=)` on a Model built with the net alone,
`model.layers`, optimizer options by name (momentum=, weight_decay=, betas=) checked against the optimizer, the
metrics' running values in batch logs, and the summary line's effective batch for a DataLoader used as given."""
from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import easyfit
from easyfit.callbacks import LambdaCallback, ProgressBar


def data(samples: int = 64):
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(samples, 4, generator=generator)
    return x, (x[:, 0] + x[:, 1] > 0).long()


def make_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))


def plain_weights(optimizer_factory, epochs: int = 2) -> dict:
    x, y = data()
    net = make_net()
    optimizer = optimizer_factory(net.parameters())
    for _ in range(epochs):
        for inputs, target in zip(x.split(16), y.split(16)):
            optimizer.zero_grad()
            nn.functional.cross_entropy(net(inputs), target).backward()
            optimizer.step()
    return net.state_dict()


def assert_weights(net: nn.Module, expected: dict) -> None:
    for name, value in expected.items():
        torch.testing.assert_close(net.state_dict()[name], value, atol=1e-5, rtol=0)


def fit(model: easyfit.Model, epochs: int = 2, **kwargs):
    return model.fit(*data(), batch_size=16, epochs=epochs, shuffle=False, verbose=0, **kwargs)


def test_compile_sets_the_optimizer_loss_and_metrics_of_a_model_built_with_the_net_alone():
    model = easyfit.Model(make_net())
    model.compile(optimizer="sgd", loss="cross_entropy", metrics=["accuracy"], lr=0.1, momentum=0.9)
    history = fit(model)
    assert list(history.history) == ["loss", "accuracy"]
    assert_weights(model.net, plain_weights(lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9)))
    assert model.layers == list(model.net.children()) and len(model.layers) == 3


@pytest.mark.parametrize("name, options, build", [
    ("sgd", {"momentum": 0.9, "weight_decay": 1e-2},
     lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9, weight_decay=1e-2)),
    ("adam", {"betas": (0.8, 0.99), "weight_decay": 1e-3},
     lambda params: torch.optim.Adam(params, lr=0.05, betas=(0.8, 0.99), weight_decay=1e-3)),
])
def test_optimizer_options_by_name_train_as_the_optimizer_built_with_them(name, options, build, tmp_path):
    model = easyfit.Model(make_net(), "cross_entropy", name, lr=0.05, **options)
    fit(model)
    assert_weights(model.net, plain_weights(build))
    model.save(tmp_path / "model.pt")
    loaded = easyfit.Model.load(tmp_path / "model.pt", make_net())   # the options come back with the name
    assert {key: loaded.optimizer.param_groups[0][key] for key in options} == options


def test_a_wrong_optimizer_option_is_refused_with_the_closest_one():
    with pytest.raises(TypeError, match="SGD takes no option 'momentun'. Did you mean 'momentum'"):
        easyfit.Model(make_net(), optimizer="sgd", momentun=0.9)
    with pytest.raises(TypeError, match="Adam takes no option 'schedular'. Did you mean 'scheduler'"):
        easyfit.Model(make_net(), schedular=None)
    net = make_net()
    with pytest.raises(ValueError, match="apply only to an optimizer given by name"):
        easyfit.Model(net, optimizer=torch.optim.SGD(net.parameters(), lr=0.1), momentum=0.9)


def test_batch_logs_carry_the_running_value_of_each_metric():
    x, y = data()
    model = easyfit.Model(make_net(), "cross_entropy", "sgd", metrics=["accuracy"], lr=0.0)   # weights fixed
    with torch.no_grad():
        correct = (model.net(x).argmax(1) == y).float()
    seen = []
    history = fit(model, epochs=1, callbacks=[LambdaCallback(
        on_train_batch_end=lambda batch, logs: seen.append((sorted(logs), logs["accuracy"])))])
    assert [keys for keys, _ in seen] == [["accuracy", "batch_loss", "loss", "size"]] * 4
    assert [value for _, value in seen] == pytest.approx([float(correct[:16 * (i + 1)].mean()) for i in range(4)])
    assert history.history["accuracy"] == [pytest.approx(seen[-1][1])]


def test_the_progress_bar_shows_the_running_metrics(capsys):
    model = easyfit.Model(make_net(), "cross_entropy", "sgd", metrics=["accuracy"])
    bar = ProgressBar(refresh_seconds=0.0)
    postfixes = []
    fit(model, epochs=1, callbacks=[bar, LambdaCallback(on_train_batch_end=lambda batch, logs: postfixes.append(
        bar.bar.postfix))])
    assert len(postfixes) == 4 and all("loss: " in text and " - accuracy: " in text for text in postfixes)


def test_the_effective_batch_of_a_dataloader_used_as_given_is_its_batch_size():
    loader = DataLoader(TensorDataset(*data()), batch_size=16)
    history = easyfit.Model(make_net()).fit(loader, verbose=0)   # fit's batch_size (32) does not apply
    assert history.params["batch_size"] == history.params["effective_batch_size"] == 16
    assert history.params["summary"].startswith("effective batch 16 = 16 × 1 process")


def test_batch_logs_list_the_metrics_that_have_a_value_in_every_epoch():
    model = easyfit.Model(make_net(), "cross_entropy", "sgd", metrics=["accuracy"])
    listed = []
    fit(model, epochs=2, callbacks=[LambdaCallback(on_train_batch_end=lambda batch, logs: listed.append(dict(logs)))])
    assert all("accuracy" in logs for logs in listed) and len(listed) == 8
