"""Model.summary's layer table and History.plot's curves."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from torch import nn

import easyfit
from easyfit.training.summary import summarize
from easyfit.utils.plotting import plot_history


class Scaled(nn.Module):
    """A module with a parameter of its own next to its children."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(3))
        self.body = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 3))
        self.norm = nn.BatchNorm1d(3)

    def forward(self, x):
        return self.norm(self.body(x) * self.scale)


def table_rows(text: str) -> dict[str, list[str]]:
    """Rows between the header's closing rule and the final rule, by layer name."""
    lines = text.splitlines()
    rules = [index for index, line in enumerate(lines) if set(line) == {"="}]
    return {line.split()[0]: line.split()[1:] for line in lines[rules[1] + 1:rules[2]]}


def test_summary_counts_every_parameter_and_shows_output_shapes():
    net = Scaled()
    net.norm.requires_grad_(False)
    text = summarize(net, torch.randn(5, 4))
    rows = table_rows(text)
    assert rows == {"(net)": ["Scaled", "(5,", "3)", "3"], "body.0": ["Linear", "(5,", "6)", "30"],
                    "body.1": ["ReLU", "(5,", "6)", "0"], "body.2": ["Linear", "(5,", "3)", "21"],
                    "norm": ["BatchNorm1d", "(5,", "3)", "6"]}
    total = sum(p.numel() for p in net.parameters())
    assert f"Total params: {total}" in text and total == 60
    assert "Trainable params: 54" in text and "Non-trainable params: 6" in text
    assert net.training and all(not hooks for hooks in (m._forward_hooks for m in net.modules()))


def test_summary_without_an_example_and_through_the_model():
    net = nn.Sequential(nn.Linear(4, 1000), nn.Linear(1000, 2))
    text = easyfit.Model(net).summary(print_fn=None)
    assert text == summarize(net)
    assert table_rows(text)["0"] == ["Linear", "?", "5,000"] and "Total params: 7,002" in text
    assert sum(p.numel() for p in net.parameters()) == 7002


def test_summary_of_a_net_taking_several_inputs():
    class Pair(nn.Module):
        def __init__(self):
            super().__init__()
            self.left, self.right = nn.Linear(2, 3), nn.Linear(5, 3)

        def forward(self, a, b):
            return self.left(a) + self.right(b)

    rows = table_rows(summarize(Pair(), (torch.randn(7, 2), torch.randn(7, 5))))
    assert rows["left"][1:3] == ["(7,", "3)"] and rows["right"][-1] == "18"


@pytest.fixture
def history(regression):
    model = easyfit.Model(nn.Linear(4, 1), "mse", "sgd", metrics=["mae"])
    return model.fit(*regression, epochs=3, validation_split=0.25, verbose=0)


def test_history_plot_writes_a_png(history, tmp_path):
    path = tmp_path / "curves.png"
    figure = history.plot(path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 1000
    assert [axes.get_title() for axes in figure.axes] == ["loss", "mae"]
    for axes in figure.axes:
        assert [line.get_label() for line in axes.lines] == ["train", "validation"]
        assert list(axes.lines[0].get_xdata()) == [1, 2, 3]
    assert list(figure.axes[1].lines[1].get_ydata()) == history.history["val_mae"]


def test_plot_picks_keys_and_places_sparse_validation():
    figure = plot_history({"loss": [4.0, 3.0, 2.0, 1.0], "val_loss": [3.5, 1.5], "lr": [0.1] * 4}, keys=["loss"])
    (axes,) = figure.axes
    assert list(axes.lines[1].get_xdata()) == [2, 4]   # validation every 2 epochs
    with pytest.raises(ValueError, match="nothing to plot for \\['accuracy'\\]; the history has: loss, val_loss"):
        plot_history({"loss": [1.0], "val_loss": [1.0]}, keys=["accuracy"])


def test_plot_without_matplotlib_says_what_to_install(history, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(ImportError, match=r"pip install easyfit\[plot\]"):
        history.plot()


@pytest.mark.timeout(60)
def test_matplotlib_is_imported_only_when_plotting():
    code = ("import sys, easyfit, easyfit.utils.plotting, easyfit.training.summary, easyfit.callbacks; "
            "assert 'matplotlib' not in sys.modules, 'matplotlib imported too early'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
