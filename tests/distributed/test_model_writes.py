"""A fit keeps its state in one object on the Model (`model.running`, None outside a call): whatever the strategy,
a fit assigns on the user's Model that attribute and its results only. The strategies of one process and
ddp_spawn's caller run here; the others in one 2-process launch (and fsdp_tp in one of 4) of
tests/distributed/scripts/model_writes.py."""
from __future__ import annotations

import importlib
import importlib.util
import os

import pytest
import torch
from runner import make_data, make_net, run_script

import easyfit
from easyfit.distributed import calls

WRITES = importlib.import_module("model_writes")   # tests/distributed/scripts, which runner puts on sys.path

pytestmark = pytest.mark.timeout(600)

#: what a fit may assign on the Model: the running call (set, then dropped) and the results it leaves
RESULTS = {
    "running",            # the call's one object while it runs, None again at its end
    "history",            # the fit's History (fit returns it)
    "completed_epochs",   # the epochs trained, and how far the last one went (what a checkpoint after it holds)
    "position",
    "_last_call",         # what `save` after the call writes with: its scaler, callbacks' states, device generator
    "_input_example",     # the call's first batch, which `export` traces
}
TWO_RANKS = ["ddp", "fsdp", "tp", "zero", "pipeline",
             *(["deepspeed_stage_1", "deepspeed_stage_2", "deepspeed_stage_3"]
               if importlib.util.find_spec("deepspeed") is not None else []),
             *(["ddp_sharded"] if importlib.util.find_spec("fairscale") is not None else [])]


def assert_results_only(found: dict, strategies: list[str]) -> None:
    """Each fit assigned results only, and where its ranks ran in this process (not ddp_spawn's caller) its call."""
    assert list(found) == strategies
    for strategy, names in found.items():
        assert set(names) <= RESULTS, (strategy, sorted(set(names) - RESULTS))
        assert strategy == "ddp_spawn" or "running" in names, strategy


def test_a_fit_in_this_process_assigns_its_call_and_results_only_on_the_model(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(calls, "is_interactive", lambda: False)
    found = {strategy: WRITES.fit_writes(strategy, 1) for strategy in ("single", "ddp", "ddp2")}
    found["ddp_spawn"] = WRITES.fit_writes("ddp_spawn", 2)   # the caller's Model, which rank 0's state comes back to
    assert_results_only(found, ["single", "ddp", "ddp2", "ddp_spawn"])
    model = easyfit.Model(make_net(), "cross_entropy", "adam")
    with pytest.raises(RuntimeError, match="strategy='dp'"), WRITES.assignments_recorded(easyfit.Model) as names:
        model.fit(*make_data(), epochs=1, verbose=0, accelerator="cpu", strategy="dp")
    assert names == set() and model.running is None


@pytest.mark.parametrize("devices, strategies", [(2, TWO_RANKS), (4, ["fsdp_tp"])], ids=["2 ranks", "fsdp_tp"])
def test_a_fit_on_several_ranks_assigns_its_call_and_results_only_on_the_model(tmp_path, devices, strategies):
    process = run_script(tmp_path, str(devices), *strategies, script="model_writes.py", timeout=500,
                         env={"TORCH_EXTENSIONS_DIR": str(tmp_path / "ops")})
    assert process.returncode == 0, process.stderr[-6000:]
    for rank in range(devices):
        assert_results_only(torch.load(os.path.join(tmp_path, f"{rank}.pt"), weights_only=False), strategies)
