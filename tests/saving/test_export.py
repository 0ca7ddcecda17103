"""model.export: each artifact (ONNX run by onnxruntime, .pt2 read by torch.export.load) computes what predict
computes, at batch sizes other than the example's, for the kinds of nets users train; after a ddp and an fsdp fit on
2 processes too. A net torch.export cannot trace is refused, and no file is left."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from nets import tiny_net
from torch import nn

import easyfit
from easyfit.saving.export import ExportError

ort = pytest.importorskip("onnxruntime", reason="pip install easyfit[export]")
pytest.importorskip("onnxscript", reason="pip install easyfit[export]")

SCRIPT = Path(__file__).parent / "scripts" / "export_after_fit.py"
TOLERANCE = 1e-5


class LastStep(nn.Module):
    def __init__(self):
        super().__init__()
        self.lstm, self.head = nn.LSTM(4, 8, batch_first=True), nn.Linear(8, 3)

    def forward(self, x):
        out, _ = self.lstm(x)
        return self.head(out[:, -1])


class ImageAndMeta(nn.Module):
    def __init__(self):
        super().__init__()
        self.pixels, self.extra = nn.Sequential(nn.Flatten(), nn.Linear(16, 3)), nn.Linear(2, 3)

    def forward(self, image, meta):
        return self.pixels(image) + self.extra(meta)


class SignBranch(nn.Module):
    """A forward whose path depends on the data: torch.export cannot trace it."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 3)

    def forward(self, x):
        return self.linear(x) if x.sum() > 0 else -self.linear(x)


def bert():
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(vocab_size=32, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=32, max_position_embeddings=16, num_labels=2)
    return transformers.BertForSequenceClassification(config)


def causal_lm():
    """A tiny transformers causal LM: its forward takes the item count of a counted loss, and returns a cache."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=32, n_positions=16, n_embd=16, n_layer=1, n_head=2,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(config)


def case(name: str, generator: torch.Generator) -> tuple[nn.Module, object, object, str]:
    """(net, x, y, loss) of a fit; x is a tensor or a dict of inputs."""
    torch.manual_seed(0)
    labels = torch.randint(0, 3, (24,), generator=generator)
    if name == "mlp":
        return tiny_net(), torch.randn(24, 4, generator=generator), labels, "cross_entropy"
    if name == "cnn":
        net = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.MaxPool2d(2),
                            nn.Flatten(), nn.Linear(64, 3))
        return net, torch.randn(24, 1, 8, 8, generator=generator), labels, "cross_entropy"
    if name == "lstm":
        return LastStep(), torch.randn(24, 5, 4, generator=generator), labels, "cross_entropy"
    if name == "dict":
        x = {"image": torch.randn(24, 4, 4, generator=generator), "meta": torch.randn(24, 2, generator=generator)}
        return ImageAndMeta(), x, labels, "cross_entropy"
    ids = torch.randint(1, 32, (24, 7), generator=generator)
    x = {"input_ids": ids, "attention_mask": (torch.rand(24, 7, generator=generator) > 0.2).long()}
    return bert(), x, labels % 2, "model"   # the labels go into the forward: the example must leave them out


def first(x, n: int):
    return {key: value[:n] for key, value in x.items()} if isinstance(x, dict) else x[:n]


def onnx_output(path: Path, inputs) -> torch.Tensor:
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    names = [entry.name for entry in session.get_inputs()]
    if isinstance(inputs, dict):
        assert names == list(inputs), "the ONNX inputs are named after the forward's arguments"
        feed = {name: value.numpy() for name, value in inputs.items()}
    else:
        feed = {names[0]: inputs.numpy()}
    return torch.from_numpy(session.run(None, feed)[0])


def program_output(path: Path, inputs) -> torch.Tensor:
    net = torch.export.load(str(path)).module()
    output = net(**inputs) if isinstance(inputs, dict) else net(inputs)
    return output.logits if hasattr(output, "logits") else output


def assert_serves_as_predict(model: easyfit.Model, folder: Path, x) -> None:
    """The .onnx and .pt2 files in `folder` compute predict's outputs at two batch sizes (the trace saw 2)."""
    for n in (3, 5):
        inputs = first(x, n)
        expected = model.predict(inputs)
        expected = expected.logits if hasattr(expected, "logits") else expected
        torch.testing.assert_close(onnx_output(folder / "net.onnx", inputs), expected, atol=TOLERANCE, rtol=0)
        torch.testing.assert_close(program_output(folder / "net.pt2", inputs), expected, atol=TOLERANCE, rtol=0)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", ["mlp", "cnn", "lstm", "dict", "bert"])
def test_each_artifact_computes_what_predict_computes_at_any_batch_size(name, tmp_path):
    net, x, y, loss = case(name, torch.Generator().manual_seed(0))
    model = easyfit.Model(net, loss, "sgd", lr=0.05)
    model.fit(x, y, epochs=1, batch_size=8, verbose=0)   # the export traces with its first batch
    model.export(tmp_path / "net.onnx")
    model.export(tmp_path / "net.pt2")
    assert net.training is False   # as fit left it: eval; export works on a copy
    assert_serves_as_predict(model, tmp_path, x)
    assert sorted(os.listdir(tmp_path)) == ["net.onnx", "net.pt2"]   # no temporary file left


@pytest.mark.timeout(300)
def test_an_example_given_a_format_named_and_a_float64_net_exported_in_float32(tmp_path):
    net = tiny_net().double()
    model = easyfit.Model(net)
    x = torch.randn(6, 4, dtype=torch.float64)
    model.export(tmp_path / "net.model", format="torch", input_example=x[:1])   # one sample: still any batch size
    program = torch.export.load(str(tmp_path / "net.model")).module()
    torch.testing.assert_close(program(x.float()), net(x).float(), atol=TOLERANCE, rtol=0)
    assert next(net.parameters()).dtype == torch.float64   # the net itself is unchanged


def test_what_cannot_be_exported_is_refused_before_any_file(tmp_path):
    model = easyfit.Model(tiny_net())
    with pytest.raises(ValueError, match="needs an example input.*input_example="):
        model.export(tmp_path / "net.onnx")
    with pytest.raises(ValueError, match=r"cannot tell the format from the suffix '\.bin'.*\*\.onnx or \*\.pt2"):
        model.export(tmp_path / "net.bin", input_example=torch.randn(2, 4))
    with pytest.raises(ValueError, match="format must be 'onnx' or 'torch'"):
        model.export(tmp_path / "net.onnx", format="tflite", input_example=torch.randn(2, 4))
    assert os.listdir(tmp_path) == []


@pytest.mark.timeout(300)
@pytest.mark.parametrize("suffix", ["onnx", "pt2"])
def test_an_untraceable_net_is_refused_with_torchs_reason_and_no_file(suffix, tmp_path):
    model = easyfit.Model(SignBranch())
    model.predict(torch.randn(4, 4))
    with pytest.raises(ExportError, match=r"cannot trace SignBranch \(module .*test_export\).*nothing was written"
                                          r".*torch's reason: .*data-dependent"):
        model.export(tmp_path / f"net.{suffix}")
    assert os.listdir(tmp_path) == []


@pytest.mark.timeout(400)
def test_after_a_ddp_and_an_fsdp_fit_rank_zero_exports_the_plain_trained_net(tmp_path):
    finished = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path)], capture_output=True, text=True,
                              timeout=360, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert finished.returncode == 0, finished.stderr[-4000:]
    assert sorted(os.listdir(tmp_path)) == sorted(f"{strategy}-{what}" for strategy in ("ddp", "fsdp")
                                                  for what in ("rank0.onnx", "rank0.pt2", "predicted.pt"))
    for strategy in ("ddp", "fsdp"):
        predicted = torch.load(tmp_path / f"{strategy}-predicted.pt")
        for inputs, expected in predicted.values():
            torch.testing.assert_close(onnx_output(tmp_path / f"{strategy}-rank0.onnx", inputs), expected,
                                       atol=TOLERANCE, rtol=0)
            torch.testing.assert_close(program_output(tmp_path / f"{strategy}-rank0.pt2", inputs), expected,
                                       atol=TOLERANCE, rtol=0)


@pytest.mark.timeout(300)
def test_after_a_ddp_spawn_fit_the_example_comes_back_from_rank_zero(tmp_path):
    torch.manual_seed(0)
    x, y = torch.randn(32, 4), torch.randint(0, 3, (32,))
    model = easyfit.Model(tiny_net(), "cross_entropy", "sgd", lr=0.1)
    model.fit(x, y, epochs=1, batch_size=8, verbose=0, devices=2, accelerator="cpu", strategy="ddp_spawn")
    model.export(tmp_path / "net.pt2")   # rank 0 ran in another process: its first batch is the example
    torch.testing.assert_close(program_output(tmp_path / "net.pt2", x[:5]), model.predict(x[:5]), atol=TOLERANCE,
                               rtol=0)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("call", ["fit", "evaluate"])
def test_a_causal_lm_exports_after_its_own_loss_with_the_user_s_inputs_only(call, tmp_path):
    """A counted loss's step adds num_items_in_batch to the forward's inputs: the example keeps the user's inputs."""
    ids = torch.randint(1, 32, (8, 6), generator=torch.Generator().manual_seed(0))
    model = easyfit.Model(causal_lm(), "model", "sgd", lr=0.1)
    getattr(model, call)({"input_ids": ids}, ids, batch_size=4, verbose=0)
    assert list(model._input_example) == ["input_ids"]
    model.export(tmp_path / "net.pt2")
    with torch.no_grad():
        expected = model.net(input_ids=ids[:3]).logits
    torch.testing.assert_close(program_output(tmp_path / "net.pt2", {"input_ids": ids[:3]}), expected,
                               atol=TOLERANCE, rtol=0)
