"""Kubeflow's training operator (PyTorchJob) runs `torchrun` in each pod with the rendezvous in its variables: the
PET_* ones torchrun reads as its options, and the pod's MASTER_ADDR, MASTER_PORT, WORLD_SIZE and RANK. Two such pods'
environments, as the operator writes them, on loopback: easyfit follows torchrun's environment in each and trains
what plain PyTorch trains on the combined batch."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
from runner import SCRIPTS, assert_exact_evaluation, assert_same_weights, finished_together, reference_weights, result

from easyfit.distributed.environments import find_free_port

pytestmark = pytest.mark.timeout(240)


def pod_environment(pod: int, port: int) -> dict:
    """What the operator sets in pod `pod` of a 2-pod PyTorchJob with one process per pod (the Master is pod 0)."""
    return {"PET_NNODES": "2", "PET_NPROC_PER_NODE": "1", "PET_NODE_RANK": str(pod),
            "PET_MASTER_ADDR": "127.0.0.1", "PET_MASTER_PORT": str(port),
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "2", "RANK": str(pod),
            "PYTHONUNBUFFERED": "1"}


def test_two_pods_of_a_pytorchjob_train_as_plain_pytorch_on_the_combined_batch(tmp_path):
    port = find_free_port()
    pods = []
    for pod in range(2):
        out = tmp_path / f"pod{pod}"
        out.mkdir()
        # torchrun's logs in the pod's folder (else it leaves a folder of them in /tmp each run)
        env = {**os.environ, "OMP_NUM_THREADS": "1", **pod_environment(pod, port), "PET_LOG_DIR": str(out / "logs")}
        # the container's command: torchrun SCRIPT, every torchrun option from the PET_* variables
        pods.append(subprocess.Popen([sys.executable, "-m", "torch.distributed.run", str(SCRIPTS / "train.py"),
                                      str(out), "ddp", "--lr", "0.1", "--devices", "1", "--num-nodes", "2"],
                                     env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    ends = finished_together(pods)
    for end in ends:
        assert end.returncode == 0, end.stderr[-4000:]
    outcome = result(tmp_path / "pod0")
    assert outcome["world_size"] == 2 and not (tmp_path / "pod1" / "result.pt").exists()
    assert_same_weights(outcome["state"], reference_weights(0.1))
    assert_exact_evaluation(outcome)
