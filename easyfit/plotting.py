"""Training curves from a History: one panel per quantity, train and validation together."""
from __future__ import annotations

import os
from typing import Any


def plot_history(history: Any, path: str | os.PathLike | None = None, keys: list[str] | None = None):
    """A matplotlib Figure with one panel per base key ("loss", "accuracy", ...) showing it and its val_ twin
    against the epoch (from 1). `history` is a History or its `.history` dict; `keys` picks the base keys.

    Saves to `path` when given (any format matplotlib knows by the extension). Needs no display.
    """
    try:
        import matplotlib  # noqa: F401  (imported first so that a missing matplotlib is reported as such)
        from matplotlib.figure import Figure
    except ImportError:
        raise ImportError("plotting the history needs matplotlib: pip install easyfit[plot]") from None
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


def _epochs_of(count: int, epochs: list[int]) -> list[int]:
    """The epochs of a series of `count` values: all of them, or every k-th when validation ran every k epochs."""
    every = max(len(epochs) // count, 1)
    return epochs[every - 1::every][:count]
