"""Run the distributed test scripts as real programs, with timeouts, and check no process outlives them."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any, Callable

import torch

SCRIPTS = Path(__file__).parent / "scripts"
sys.path.insert(0, str(SCRIPTS))
from common import make_data, make_net


def run_script(out: Path, *args: str, env: dict | None = None, timeout: float = 150,
               script: str = "train.py") -> subprocess.CompletedProcess:
    """Run tests/distributed/scripts/<script> OUT ARGS... and return the finished process."""
    environment = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run([sys.executable, str(SCRIPTS / script), str(out), *args], env=environment,
                          capture_output=True, text=True, timeout=timeout)


def start_script(out: Path, *args: str, env: dict | None = None, script: str = "train.py") -> subprocess.Popen:
    """Start the script; it takes Ctrl-C (SIGINT) as a terminal's foreground program does, even where this test
    runs as a background job, whose children inherit SIGINT ignored."""
    environment = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.Popen([sys.executable, str(SCRIPTS / script), str(out), *args], env=environment,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def finished(process: subprocess.Popen, timeout: float = 200) -> subprocess.CompletedProcess:
    """A started script's end, as subprocess.run returns it."""
    stdout, stderr = process.communicate(timeout=timeout)
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)


def finished_together(processes: list[subprocess.Popen], timeout: float = 200) -> list[subprocess.CompletedProcess]:
    """The ends of started processes that wait for one another (the nodes of one run): the first to fail stops the
    others at once, whose rendezvous would wait for it until their timeout; past `timeout` all are stopped."""
    with ThreadPoolExecutor(len(processes)) as pool:
        ends = {pool.submit(process.communicate): process for process in processes}
        pending, deadline = set(ends), time.monotonic() + timeout
        try:
            while pending and all(ends[end].returncode == 0 for end in ends if end.done()):
                done, pending = wait(pending, timeout=max(deadline - time.monotonic(), 0), return_when=FIRST_COMPLETED)
                if not done:
                    raise subprocess.TimeoutExpired(processes[0].args, timeout)
        finally:
            for process in processes:
                if process.poll() is None:
                    process.kill()
        outputs = [end.result() for end in ends]
    return [subprocess.CompletedProcess(process.args, process.returncode, *output)
            for process, output in zip(processes, outputs)]


def launch_early(request, tmp_path_factory, test: str, *args: str, script: str):
    """For an autouse module fixture: where the module's test `test` is to run, start the script now, as the module
    begins, and yield (OUT, the process), else None. A launch that mostly waits (a stuck rank's timeout) then waits
    while the module's other tests run, instead of idling its core. It ends by itself; the module's end waits for it."""
    if not any(item.name == test for item in request.session.items):
        yield None
        return
    out = tmp_path_factory.mktemp("early")
    process = start_script(out, *args, script=script)
    try:
        yield out, process
    finally:
        try:
            process.communicate(timeout=300)
        except subprocess.TimeoutExpired:   # as subprocess.run's timeout does
            process.kill()
            raise


def launch_once(tmp_path_factory, launch: Callable[..., Any]) -> Callable[..., tuple]:
    """For a module fixture that tests share: launch(OUT, *key) runs once per key, in a new folder; every call with
    the key returns (OUT, what that run returned)."""
    launched = {}

    def run(*key) -> tuple:
        if key not in launched:
            out = tmp_path_factory.mktemp("launch")
            launched[key] = out, launch(out, *key)
        return launched[key]
    return run


def result(out: Path) -> dict:
    return torch.load(out / "result.pt", weights_only=False)


def processes_running(marker: str) -> list[int]:
    """PIDs of live (non-zombie) processes whose command line contains `marker`."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            state = (entry / "stat").read_text().split(")")[-1].split()[0]
        except OSError:
            continue
        if marker in cmdline and state != "Z":
            pids.append(int(entry.name))
    return pids


def reference_weights(lr: float, batch_size: int = 32, epochs: int = 2) -> dict:
    """Plain PyTorch: the same net and data, one process, no shuffling."""
    x, y = make_data()
    net = make_net()
    optimizer = torch.optim.SGD(net.parameters(), lr=lr)
    for _ in range(epochs):
        for start in range(0, len(x), batch_size):
            loss = torch.nn.functional.cross_entropy(net(x[start:start + batch_size]), y[start:start + batch_size])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    return net.state_dict()


def assert_same_weights(actual: dict, expected: dict, atol: float = 1e-5) -> None:
    for name, value in expected.items():
        difference = (actual[name] - value).abs().max().item()
        assert difference <= atol, f"{name} differs by {difference}"


def assert_exact_evaluation(outcome: dict) -> dict:
    """The scores and predictions of a multi-process run (result.pt of the scripts) equal one process's on the
    same trained weights; returns that process's scores."""
    import easyfit
    x, y = make_data()
    net = make_net()
    net.load_state_dict(outcome["state"])
    single = easyfit.Model(net, "cross_entropy", "sgd", metrics=["accuracy"])
    expected = single.evaluate(x[:101], y[:101], batch_size=8, verbose=0, return_dict=True)
    assert abs(outcome["scores"]["loss"] - expected["loss"]) <= 1e-6, (outcome["scores"], expected)
    assert abs(outcome["scores"]["accuracy"] - expected["accuracy"]) <= 1e-6, (outcome["scores"], expected)
    torch.testing.assert_close(outcome["predictions"], single.predict(x[:101], batch_size=8))
    return expected
