"""The default progress bar in an 80-column terminal: every value, val_ ones included, shown whole."""
from __future__ import annotations

import fcntl
import os
import pty
import re
import struct
import subprocess
import sys
import termios

import numpy as np
import pytest
from torch import nn

import easyfit
from easyfit.callbacks import progress

pytest.importorskip("tqdm", reason="the progress bar is tqdm's")
ESCAPES = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def shown_lines(stream: str) -> list[str]:
    """What a terminal shows of `stream`, line by line: each redraw after a carriage return replaces the line."""
    return [ESCAPES.sub("", line.split("\r")[-1]) for line in stream.split("\n") if line.strip()]


def every_draw(stream: str) -> list[str]:
    return [ESCAPES.sub("", part) for line in stream.split("\n") for part in line.split("\r") if part.strip()]


@pytest.fixture(autouse=True)
def no_other_bars(monkeypatch):
    """tqdm draws a new bar below those still open in the process: a bar another test left open here (a library's,
    say Ray Data's) would move these tests' bars down a line."""
    from weakref import WeakSet

    from tqdm import std
    monkeypatch.setattr(std.tqdm, "_instances", WeakSet())


@pytest.fixture
def terminal(monkeypatch):
    """A terminal of 80 columns (tqdm reads COLUMNS and LINES where the stream is not a terminal itself)."""
    monkeypatch.setenv("COLUMNS", "80")
    monkeypatch.setenv("LINES", "24")
    monkeypatch.setattr(progress, "redraws_in_place", lambda: True)


def test_a_fit_in_80_columns_shows_every_value_whole(terminal, capfd):
    generator = np.random.default_rng(0)
    x, y = generator.normal(size=(64, 4)).astype("float32"), generator.integers(0, 3, 64)
    model = easyfit.Model(nn.Linear(4, 3), "cross_entropy", "sgd", metrics=["accuracy", "f1"], lr=0.1)
    history = model.fit(x, y, epochs=2, batch_size=16, validation_split=0.25, verbose=1)
    err = capfd.readouterr().err
    assert max(len(line) for line in every_draw(err)) <= 80
    shown = "\n".join(shown_lines(err))
    for key, values in history.history.items():   # loss, accuracy, f1 and their val_ twins, each epoch
        for value in values:
            assert f"{key}: {value:.4f}" in shown, (key, shown)


def test_a_wide_terminal_keeps_the_values_on_the_bar_line(monkeypatch, capfd):
    monkeypatch.setenv("COLUMNS", "250")
    monkeypatch.setenv("LINES", "24")
    bar = progress.ProgressBar()
    bar.set_params({"epochs": 1, "steps_per_epoch": 2})
    bar.on_epoch_begin(0)
    bar.on_train_batch_end(0, {"loss": 1.0})
    bar.on_epoch_end(0, {"loss": 0.5, "accuracy": 0.75, "val_loss": 0.625, "val_accuracy": 0.8125})
    (line,) = shown_lines(capfd.readouterr().err)
    assert line.startswith("Epoch 1/1") and line.endswith(
        "loss: 0.5000 - accuracy: 0.7500 - val_loss: 0.6250 - val_accuracy: 0.8125]")


FIT_IN_A_TERMINAL = """
import torch, easyfit
from torch import nn
torch.manual_seed(0)
model = easyfit.Model(nn.Linear(4, 2), "cross_entropy", "sgd", metrics=["accuracy"])
model.fit(torch.randn(64, 4), torch.randint(0, 2, (64,)), epochs=1, batch_size=16, verbose=1)
"""


def test_a_terminal_that_reports_0x0_with_columns_set_still_shows_the_bar(tmp_path):
    """A pseudo-terminal of 0 rows and 0 columns (as some CI runners and containers open) with COLUMNS set: the bar
    and the epoch's values are drawn, not empty lines."""
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 0, 0, 0, 0))
    env = {key: value for key, value in os.environ.items() if key != "LINES"}
    process = subprocess.Popen([sys.executable, "-c", FIT_IN_A_TERMINAL], stdin=follower, stdout=follower,
                               stderr=follower, env={**env, "COLUMNS": "80"}, cwd=tmp_path)
    os.close(follower)
    shown = b""
    while True:   # until the script closes the terminal
        try:
            chunk = os.read(leader, 4096)
        except OSError:   # the follower side closed
            break
        if not chunk:
            break
        shown += chunk
    os.close(leader)
    assert process.wait(timeout=120) == 0, shown.decode()
    lines = shown_lines(shown.decode().replace("\r\n", "\n"))
    assert any(line.startswith("Epoch 1/1: 100%") for line in lines), lines
    assert any(line.startswith("loss: ") for line in lines), lines


class StopAtSecondBatch(easyfit.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        if batch == 1:
            raise KeyboardInterrupt


def test_an_interrupted_fit_leaves_no_bar_open_so_the_next_bar_draws_on_its_own_line(terminal, capfd):
    """A fit stopped mid-epoch (Ctrl-C in a notebook) closes its bar where it stood: the next fit's bar is drawn at
    the first position, not one line below a bar that stays open and is drawn again when collected."""
    from tqdm.auto import tqdm
    model = easyfit.Model(nn.Linear(4, 2), "cross_entropy", "sgd")
    x, y = np.zeros((64, 4), dtype="float32"), np.zeros(64, dtype="int64")
    with pytest.raises(KeyboardInterrupt):
        model.fit(x, y, epochs=1, batch_size=16, verbose=1, callbacks=[StopAtSecondBatch()])
    interrupted = capfd.readouterr().err
    assert not tqdm._instances
    assert interrupted.endswith("\n") and "2/4" in shown_lines(interrupted)[-1]
    model.fit(x, y, epochs=1, batch_size=16, verbose=1)
    err = capfd.readouterr().err
    assert "\x1b[A" not in err, err
    (line,) = [line for line in shown_lines(err) if line.startswith("Epoch")]
    assert "4/4" in line
