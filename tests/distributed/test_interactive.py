"""The notebook path: in a session without a script file, several processes come from the fork launcher.

A subprocess mimics the session: `python -` (code on stdin, so there is no script to re-run) or the REPL
(`python -i`). It trains a tiny net on 2 CPU processes and prints what happened as RESULT lines.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(150)

SESSION = '''
import json
import torch
import easyfit
from easyfit.callbacks import Callback
from easyfit.distributed.devices import is_interactive

torch.set_num_threads(1)


class SaveRankZero(Callback):
    """Rank 0 writes the weights it trained, for the caller to compare with its own net."""
    def __init__(self, path):
        self.path = path

    def on_train_end(self, logs=None):
        if self.model.is_global_zero:
            torch.save(self.model.net.state_dict(), self.path)


def report(case, **items):
    print("RESULT", json.dumps({"case": case, **items}), flush=True)


def fit_and_report(case, **run):
    torch.manual_seed(0)
    x = torch.randn(64, 4)
    y = (x[:, 0] > 0).long()
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    initial = {name: value.clone() for name, value in net.state_dict().items()}
    path = f"{OUT}/{case}.pt"
    history = easyfit.Model(net, "cross_entropy", "sgd").fit(x, y, epochs=2, batch_size=16, verbose=0, devices=2,
                                                           accelerator="cpu", callbacks=[SaveRankZero(path)], **run)
    trained = torch.load(path)
    report(case, interactive=is_interactive(), strategy=history.params["strategy"],
           world_size=history.params["world_size"], epochs=len(history.history["loss"]),
           holds_rank_zero_weights=all(torch.equal(net.state_dict()[name], value) for name, value in trained.items()),
           changed=any(not torch.equal(initial[name], value) for name, value in net.state_dict().items()))


def try_ddp():
    net = torch.nn.Linear(4, 2)
    try:
        easyfit.Model(net, "cross_entropy", "sgd").fit(torch.randn(8, 4), torch.zeros(8, dtype=torch.long),
                                                      devices=2, accelerator="cpu", strategy="ddp", verbose=0)
    except ValueError as error:
        report("ddp", error=str(error))
    else:
        report("ddp", error=None)
'''


def run_session(tmp_path, interpreter_flag: str, calls: str) -> dict[str, dict]:
    """Run SESSION then `calls` in `python -` or `python -i`; the RESULT lines by case.

    The session runs in its own process group, killed at the end, so no forked rank outlives a failed run."""
    code = f"OUT = {str(tmp_path)!r}\n{SESSION}\n{calls}\n"
    (tmp_path / "session.py").write_text(code)
    if interpreter_flag == "-i":   # a REPL reads line by line: hand it the session as one statement
        code = f"exec(open({str(tmp_path / 'session.py')!r}).read())\n"
    process = subprocess.Popen([sys.executable, interpreter_flag, "-q" if interpreter_flag == "-i" else "-"],
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env={**os.environ, "OMP_NUM_THREADS": "1"}, start_new_session=True)
    try:
        stdout, stderr = process.communicate(code, timeout=120)
    finally:
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    results = {}
    for line in stdout.splitlines():
        if line.startswith("RESULT "):
            result = json.loads(line[len("RESULT "):])
            results[result.pop("case")] = result
    assert process.returncode == 0 and "Traceback" not in stderr, stderr[-4000:]
    return results


@pytest.fixture(scope="module")
def stdin_session(tmp_path_factory) -> dict[str, dict]:
    """One `python -` session: auto, then strategy='ddp', then ddp_notebook."""
    return run_session(tmp_path_factory.mktemp("stdin"), "-",
                       'fit_and_report("auto")\ntry_ddp()\nfit_and_report("ddp_notebook", strategy="ddp_notebook")')


def assert_trained_on_two_forked_processes(result: dict, name: str = "ddp_fork") -> None:
    assert result["interactive"]
    assert (result["strategy"], result["world_size"], result["epochs"]) == (name, 2, 2)
    assert result["changed"] and result["holds_rank_zero_weights"], "the caller's net holds the trained weights"


def test_auto_in_code_from_stdin_forks_and_trains(stdin_session):
    assert_trained_on_two_forked_processes(stdin_session["auto"])


def test_ddp_in_an_interactive_session_suggests_ddp_notebook(stdin_session):
    error = stdin_session["ddp"]["error"]
    assert error is not None and "this is a notebook or REPL" in error
    assert "Use strategy='ddp_notebook' (fork) here, or run the code as a script." in error


def test_ddp_notebook_by_name_forks_and_trains(stdin_session):
    assert_trained_on_two_forked_processes(stdin_session["ddp_notebook"], "ddp_notebook")   # reports its own name


def test_auto_in_a_repl_forks_and_trains(tmp_path):
    result = run_session(tmp_path, "-i", 'fit_and_report("auto")')
    assert_trained_on_two_forked_processes(result["auto"])
