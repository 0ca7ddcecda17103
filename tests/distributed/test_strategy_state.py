"""A strategy object is configuration, and a fit is its own object: a fit of every strategy that runs here assigns
no attribute on its configured strategy object from the call's start on the rank to its end, and leaves its
attributes (`vars`) as the call found them (what the call and the fit held lived in the `CallState` its
`setup_environment` returned and the `Fit` its `setup` returned); on the user's Model it assigns only the running
call's one object and the documented results; and a strategy's second fit leaves no socket open (a first may open
what the process keeps, as the launch's process group): the process groups a call makes end with it. One process for
the strategies of one process, one 2-process launch for the others (tests/distributed/scripts/strategy_state.py)."""
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

#: nothing assigned, nothing left, no sockets left open (where this system lets them be counted: /proc)
NOTHING_LEFT = {"assigned": [], "added": [], "removed": [], "changed": [],
                "sockets": None if STATE.open_sockets() is None else 0}
TWO_RANKS = ["ddp", "fsdp", "tp", "zero", "pipeline",
             *(["deepspeed", "deepspeed_stage_3"] if importlib.util.find_spec("deepspeed") is not None else []),
             *(["ddp_sharded"] if importlib.util.find_spec("fairscale") is not None else [])]


def check_two_fits(fits: list[dict], where, processes_of_their_own: bool = False) -> None:
    """What two fits of one strategy (`where`: which, for the message) may do: nothing on the strategy, on the Model
    only the script's `MODEL_RESULTS`; sockets the first only (what the process keeps, as the launch's process
    group), or each where each fit ran in processes of its own (started for it, they end with it)."""
    assert len(fits) == 2, where
    assert all(set(fit["model"]) <= STATE.MODEL_RESULTS for fit in fits), (where, [fit["model"] for fit in fits])
    kept = [fit["sockets"] for fit in fits] if processes_of_their_own else [fits[0]["sockets"], NOTHING_LEFT["sockets"]]
    assert [{key: value for key, value in fit.items() if key != "model"} for fit in fits] == \
        [{**NOTHING_LEFT, "sockets": sockets} for sockets in kept], (where, fits)


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
    for strategy, fits in found.items():
        check_two_fits(fits, strategy)
    assert list(found) == ["single", "ddp", "ddp2"]


def test_a_spawned_fit_leaves_its_strategy_as_it_found_it(monkeypatch, tmp_path):
    """ddp_spawn: each rank a process the launcher started and configured (`configure_rank`) for the call."""
    monkeypatch.setenv(STATE.RECORDS_VARIABLE, str(tmp_path))
    monkeypatch.setattr(easyfit.model, "call_on_rank", STATE.recorded_call_on_rank)
    x, y = make_data()
    for _ in range(2):
        model = easyfit.Model(make_net(), "cross_entropy", "adam")
        model.fit(x, y, batch_size=32, epochs=1, verbose=0, devices=2, accelerator="cpu", strategy="ddp_spawn")
    files = sorted(tmp_path.glob("*.pt"), key=os.path.getmtime)
    for rank in (0, 1):
        fits = [fit for path in files if path.name.startswith(f"{rank}-")
                for fit in torch.load(path, weights_only=False)["ddp_spawn"]]
        check_two_fits(fits, ("ddp_spawn", rank), processes_of_their_own=True)


def test_a_fit_on_two_ranks_leaves_its_strategy_as_it_found_it(tmp_path):
    process = run_script(tmp_path, *TWO_RANKS, script="strategy_state.py", timeout=280,
                         env={"TORCH_EXTENSIONS_DIR": str(tmp_path / "ops")})
    assert process.returncode == 0, process.stderr[-6000:]
    for rank in (0, 1):
        found = torch.load(os.path.join(tmp_path, f"{rank}.pt"), weights_only=False)
        for strategy, fits in found.items():
            check_two_fits(fits, (rank, strategy))
        assert list(found) == TWO_RANKS
