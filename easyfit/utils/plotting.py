"""Training curves from a History: one panel per quantity, train and validation together."""
from __future__ import annotations

import os
from typing import Any


def plot_history(history: Any, path: str | os.PathLike | None = None, keys: list[str] | None = None):
    """A matplotlib Figure with one panel per base key ("loss", "accuracy", ...) showing it and its val_ twin
    against the epoch (from 1). `history` is a History or its `.history` dict; `keys` picks the base keys.

    Saves to `path` when given (any format matplotlib knows by the extension). Needs no display.
    """
    Figure = _figure_class("the history")
    series = getattr(history, "history", history)
    bases = keys or list(dict.fromkeys(key.removeprefix("val_") for key in series))
    missing = [key for key in bases if key not in series and f"val_{key}" not in series]
    if missing or not bases:
        raise ValueError(f"nothing to plot for {missing or 'an empty history'}; the history has: "
                         f"{', '.join(series) or 'no values (train first)'}")
    epochs = [epoch + 1 for epoch in getattr(history, "epoch", [])]
    epochs = epochs or list(range(1, max(len(values) for values in series.values()) + 1))
    figure = Figure(figsize=(5 * len(bases), 3.5), layout="constrained")
    for axes, base in zip(figure.subplots(1, len(bases), squeeze=False)[0], bases):
        for key, label in ((base, "train"), (f"val_{base}", "validation")):
            if series.get(key):
                values = series[key]
                axes.plot(_epochs_of(len(values), epochs), values, marker="o", markersize=3, label=label)
        axes.set_title(base)
        axes.set_xlabel("epoch")
        axes.legend()
    if path is not None:
        figure.savefig(os.fspath(path))
    return figure


def plot_lr_curve(result: Any, path: str | os.PathLike | None = None):
    """A matplotlib Figure of a learning-rate range test (`find_lr`'s result): the smoothed loss against the
    learning rate on a log scale, the suggested rate marked. Saves to `path` when given."""
    Figure = _figure_class("the learning-rate curve")
    if not result.lrs:
        raise ValueError("nothing to plot: the learning-rate sweep recorded no steps")
    figure = Figure(figsize=(5, 3.5), layout="constrained")
    axes = figure.subplots()
    axes.plot(result.lrs, result.losses, label="smoothed loss")
    if result.suggestion is not None:
        axes.axvline(result.suggestion, color="tab:red", linestyle="--", label=f"suggested lr {result.suggestion:.2g}")
    axes.set_xscale("log")
    axes.set_xlabel("learning rate")
    axes.set_ylabel("loss")
    axes.legend()
    if path is not None:
        figure.savefig(os.fspath(path))
    return figure


def _figure_class(what: str):
    """matplotlib's Figure (which draws without a display), or an ImportError saying how to install it."""
    try:
        import matplotlib  # noqa: F401  (imported first so that a missing matplotlib is reported as such)
        from matplotlib.figure import Figure
    except ImportError:
        raise ImportError(f"plotting {what} needs matplotlib: pip install easyfit[plot]") from None
    return Figure


def _epochs_of(count: int, epochs: list[int]) -> list[int]:
    """The epochs of a series of `count` values: all of them, or every k-th when validation ran every k epochs."""
    every = max(len(epochs) // count, 1)
    return epochs[every - 1::every][:count]
