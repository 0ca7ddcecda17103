"""Nothing of one fit stays on a configuration object: a fit of every strategy that runs here leaves its configured
strategy object's attributes (`vars`) as the call found them on the rank, none added, removed or changed; what the
call and the fit held lived in their `call_state` and `fit_state`; and a strategy's second fit leaves no socket open
(a first may open what the process keeps, as the launch's process group): the process groups a call makes end with
it. One process for the strategies of one process, one 2-process launch for the others
(tests/distributed/scripts/strategy_state.py)."""
from __future__ import annotations

import importlib
import importlib.util
import os

import pytest
import torch
from runner import make_data, make_net, run_script

import easyfit
import easyfit.model
from easyfit.distributed import calls

STATE = importlib.import_module("strategy_state")   # tests/distributed/scripts, which runner puts on sys.path

pytestmark = pytest.mark.timeout(300)

#: no sockets left open (where this system lets them be counted: /proc)
NOTHING_LEFT = {"added": [], "removed": [], "changed": [], "sockets": None if STATE.open_sockets() is None else 0}
TWO_RANKS = ["ddp", "fsdp", "tp", "zero", "pipeline",
             *(["deepspeed"] if importlib.util.find_spec("deepspeed") is not None else []),
             *(["ddp_sharded"] if importlib.util.find_spec("fairscale") is not None else [])]


def first_and_second_fit(fits: list[dict]) -> list[dict]:
    """What two fits of one strategy may leave: nothing on the strategy; sockets the first only (what the process
    keeps, as the process group of the launch)."""
    assert len(fits) == 2
    return [{**NOTHING_LEFT, "sockets": fits[0]["sockets"]}, NOTHING_LEFT]


def test_a_fit_in_one_process_leaves_its_strategy_as_it_found_it(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(calls, "is_interactive", lambda: False)
    found: dict = {}
    monkeypatch.setattr(easyfit.model, "call_on_rank", STATE.recording(easyfit.model.call_on_rank, found))
    x, y = make_data()
    for strategy in ("single", "ddp", "ddp2") * 2:
        model = easyfit.Model(make_net(), "cross_entropy", "adam")
        model.fit(x, y, batch_size=32, epochs=1, verbose=0, devices=1, accelerator="cpu", strategy=strategy,
                  validation_split=0.25)
    assert found == {strategy: first_and_second_fit(fits) for strategy, fits in found.items()}
    assert list(found) == ["single", "ddp", "ddp2"]


def test_a_fit_on_two_ranks_leaves_its_strategy_as_it_found_it(tmp_path):
    process = run_script(tmp_path, *TWO_RANKS, script="strategy_state.py", timeout=280,
                         env={"TORCH_EXTENSIONS_DIR": str(tmp_path / "ops")})
    assert process.returncode == 0, process.stderr[-6000:]
    for rank in (0, 1):
        found = torch.load(os.path.join(tmp_path, f"{rank}.pt"), weights_only=False)
        assert found == {strategy: first_and_second_fit(fits) for strategy, fits in found.items()}, (rank, found)
        assert list(found) == TWO_RANKS
