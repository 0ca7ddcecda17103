"""torchvision and timm as a course uses them: an ImageFolder of PNG files through transforms v2 with augmentation,
read by loader workers, trains torchvision's ResNet-18 and a timm model by one fit, in one process and under ddp on
2 processes, each equal to a plain loop over the same batches; predict, and the ResNet exported to ONNX computes
what predict computes. Runs in the environment scripts/install_vision.sh builds (skipped without torchvision)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("torchvision", reason="the vision environment: scripts/install_vision.sh")
pytest.importorskip("timm", reason="the vision environment: scripts/install_vision.sh")

import easyfit

sys.path.insert(0, str(Path(__file__).parent))
from vision_common import BATCH, LR, NETS, STEPS, images, make_net, plain_loop, write_images

SCRIPT = Path(__file__).parent / "scripts" / "ddp_fit.py"
ROOT = Path(__file__).resolve().parents[2]   # easyfit is not installed in the vision environment
TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> str:
    folder = str(tmp_path_factory.mktemp("images"))
    write_images(folder)
    return folder


@pytest.fixture(scope="module")
def ddp_launch(folder, tmp_path_factory):
    """The ddp script, started as the module begins, and its output folder; its end is waited for where read."""
    out = tmp_path_factory.mktemp("ddp")
    process = subprocess.Popen([sys.executable, str(SCRIPT), str(out), folder], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1",
                                    "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])})
    try:
        yield out, process
    finally:
        if process.poll() is None:
            process.kill()
        process.communicate()


def assert_same_state(trained: torch.nn.Module | dict, expected: torch.nn.Module) -> None:
    state = trained if isinstance(trained, dict) else trained.state_dict()
    for key, value in expected.state_dict().items():
        torch.testing.assert_close(state[key], value, atol=TOLERANCE, rtol=0,
                                   msg=lambda message, key=key: f"{key}: {message}")


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", NETS)
def test_one_fit_equals_the_plain_loop_and_predict_serves_it(name, folder, ddp_launch, tmp_path):
    model = easyfit.Model(make_net(name), "cross_entropy", "sgd", lr=LR)
    model.fit(images(folder, augment=True), batch_size=BATCH, epochs=1, steps_per_epoch=STEPS, shuffle=False,
              verbose=0, num_workers=2)
    expected = plain_loop(name, images(folder, augment=True))
    assert_same_state(model.net, expected)
    plain = images(folder, augment=False)
    predicted = model.predict(plain, batch_size=16, num_workers=2)
    with torch.no_grad():
        inputs = torch.stack([plain[i][0] for i in range(len(plain))])
        torch.testing.assert_close(predicted, expected(inputs), atol=TOLERANCE, rtol=0)
    if name == "resnet18":   # the net exported to ONNX computes what predict computes, at any batch size
        import onnxruntime
        model.export(tmp_path / "resnet18.onnx")
        session = onnxruntime.InferenceSession(str(tmp_path / "resnet18.onnx"), providers=["CPUExecutionProvider"])
        for n in (3, 7):
            output = session.run(None, {session.get_inputs()[0].name: inputs[:n].numpy()})[0]
            torch.testing.assert_close(torch.from_numpy(output), predicted[:n], atol=TOLERANCE, rtol=0)


@pytest.mark.timeout(600)
def test_a_ddp_fit_on_two_processes_equals_the_plain_loop_on_their_shares(folder, ddp_launch):
    out, process = ddp_launch
    _, stderr = process.communicate(timeout=500)
    assert process.returncode == 0, stderr[-4000:]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)   # as each rank ran (OMP_NUM_THREADS=1): a deep net with BatchNorm over 8 samples
    try:                       # turns another summation order into differences of 1e-2 within two steps
        for name in NETS:
            assert_same_state(torch.load(out / f"{name}.pt"), plain_loop(name, images(folder, augment=True), 2))
    finally:
        torch.set_num_threads(threads)
