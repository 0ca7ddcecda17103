"""Tensor and 2-D parallelism on CPU processes (gloo): parity with plain PyTorch on the combined batch, checkpoints,
exact evaluation; the plans (auto, dict, callable) and their errors, checked without any process group.

Two launches (tests/distributed/scripts/tensor_parallel.py): "tp" on 2 processes runs every 1-D case, "fsdp_tp" on 4
runs the 2-D ones (2 data-parallel × 2 tensor-parallel)."""
from __future__ import annotations

import pytest
import torch
from runner import make_data, make_net, run_script
from tensor_parallel import OPTIMIZERS, SEQUENCE_PLAN, TinyLM, binary_data, lm_data, lm_loss, one_output_net
from torch import nn

import easyfit
from easyfit.distributed.strategies.tensor_parallel import ModelParallelStrategy, check_sequence_length, mesh_shape
from easyfit.distributed.strategy_parts.tp_auto import auto_plan
from easyfit.distributed.strategy_parts.tp_plan import check_sequence_parallel, parse_plan

pytestmark = pytest.mark.timeout(600)
CE = nn.functional.cross_entropy


def reference(net, data, loss_fn, optimizer: str, batch: int, epochs: int = 3, accumulate: int = 1,
              clip: float | None = None) -> dict:
    """Plain PyTorch, one process, the combined batch of every data-parallel rank (`batch` per micro-step)."""
    x, y = data
    optimizer = OPTIMIZERS[optimizer](net.parameters())
    losses, clipped = [], False
    for _ in range(epochs):
        total = 0.0
        for start in range(0, len(x), batch * accumulate):
            optimizer.zero_grad()
            for micro in range(start, start + batch * accumulate, batch):
                loss = loss_fn(net(x[micro:micro + batch]), y[micro:micro + batch])
                (loss / accumulate).backward()
                total += loss.item() * len(x[micro:micro + batch])
            if clip is not None:
                clipped |= bool(torch.nn.utils.clip_grad_norm_(net.parameters(), clip) > clip)
            optimizer.step()
        losses.append(total / len(x))
    assert clip is None or clipped, "the clipping case never clips: it would prove nothing"
    return {"weights": net.state_dict(), "loss": losses}


def assert_matches(found: dict, expected: dict, case: str, atol: float = 1e-5) -> None:
    """Weights within `atol`; History within `atol` relative to the loss where it is above 1 (the LM's is 2.8)."""
    difference = max((found["weights"][k] - v).abs().max().item() for k, v in expected["weights"].items())
    history = max(abs(a - b) / max(1.0, abs(b)) for a, b in zip(found["loss"], expected["loss"]))
    print(f"{case:28s} weights {difference:.1e} history {history:.1e}")
    assert len(found["loss"]) == len(expected["loss"]), case
    assert difference <= atol and history <= atol, f"{case}: weights differ by {difference}, History by {history}"


def launch(tmp_path, suite: str, devices: int) -> dict:
    process = run_script(tmp_path, suite, script="tensor_parallel.py", timeout=500, env={"TP_DEVICES": str(devices)})
    assert process.returncode == 0, process.stderr[-6000:]
    return torch.load(tmp_path / "0.pt", weights_only=False)


MLP_CASES = {"mlp_sgd_auto": ("sgd", 32, {}), "mlp_sgd_callable": ("sgd", 32, {}),
             "mlp_adamw_dict_clip": ("adamw", 16, {"accumulate": 2, "clip": 0.5})}


def test_tensor_parallel_matches_plain_pytorch_saves_resumes_and_evaluates(tmp_path):
    found = launch(tmp_path, "tp", 2)
    for case, (optimizer, batch, options) in MLP_CASES.items():
        assert_matches(found[case], reference(make_net(), make_data(), CE, optimizer, batch, **options), case)
    expected_lm = reference(TinyLM(), lm_data(), lm_loss, "adamw", 16, epochs=2)
    for case in ("lm_adamw_auto", "lm_adamw_loss_parallel", "lm_adamw_compiled", "lm_adamw_sequence"):
        assert_matches(found[case], expected_lm, case)
    assert_matches(found["mlp_adamw_compiled"], reference(make_net(), make_data(), CE, "adamw", 16),
                   "mlp_adamw_compiled")
    assert_matches(found["mlp_adamw_fsdp_compiled"], reference(make_net(), make_data(), CE, "adamw", 16),
                   "fsdp compiled, 2 ranks")
    assert found["graphs_compiled"] >= 2, "the compiled cases ran eagerly"
    net = make_net()
    bf16 = easyfit.Model(net, "cross_entropy", OPTIMIZERS["sgd"](net.parameters()))
    bf16.fit(*make_data(), batch_size=32, epochs=3, shuffle=False, verbose=0, lr_scaling=None, precision="bf16-mixed")
    bf16_expected = {"weights": bf16.net.state_dict(), "loss": bf16.history.history["loss"]}
    assert_matches(found["mlp_sgd_bf16"], bf16_expected, "mlp_sgd_bf16 against one process in bf16", atol=1e-3)
    assert "Sharded parameters" in found["summary_in_fit"], found["summary_in_fit"]
    for line in ("Total params: 163 (83 on this rank)", "0.weight: (8, 6) of (16, 6), tp: split on dim 0",
                 "2.weight: (3, 8) of (3, 16), tp: split on dim 1", "2.bias: (3,) of (3,), tp: whole"):
        assert line in found["summary_in_fit"], found["summary_in_fit"]
    assert found["kept_val_loss"] == pytest.approx(found["handed_back_val_loss"], abs=1e-6)
    print(found["lm_plan"])
    assert "8 layers split; 5 replicated" in found["lm_summary"], found["lm_summary"]

    plain = easyfit.Model(TinyLM(), lm_loss, "sgd")   # exact evaluation and predictions in input order
    plain.net.load_state_dict(found["lm_adamw_loss_parallel"]["weights"])
    expected = plain.evaluate(*lm_data(), batch_size=5, verbose=0, return_dict=True)
    assert abs(found["evaluate"]["scores"]["loss"] - expected["loss"]) <= 1e-6
    torch.testing.assert_close(found["evaluate"]["predictions"], plain.predict(lm_data()[0], batch_size=5))

    saved = found["checkpoint"]   # a plain torch.load into a fresh plain net predicts as the trained one
    net = make_net()
    net.load_state_dict(torch.load(saved["saved"]))
    torch.testing.assert_close(net(make_data()[0]).detach(), saved["predictions"], rtol=0, atol=1e-6)
    for resumed in ("from_file", "from_folder"):
        assert_matches(saved[resumed], saved["straight"], f"resumed {resumed}", atol=1e-6)


def test_two_dimensional_fsdp_tp_matches_plain_pytorch(tmp_path):
    found = launch(tmp_path, "fsdp_tp", 4)
    assert_matches(found["mlp_sgd_auto"], reference(make_net(), make_data(), CE, "sgd", 32), "fsdp_tp mlp_sgd_auto")
    assert_matches(found["mlp_adamw_dict_clip"],
                   reference(make_net(), make_data(), CE, "adamw", 16, accumulate=2, clip=0.5), "fsdp_tp mlp dict")
    assert_matches(found["mlp_sgd_callable"], reference(make_net(), make_data(), CE, "sgd", 32), "fsdp_tp callable")
    assert_matches(found["mlp_sgd_compiled"], reference(make_net(), make_data(), CE, "sgd", 32), "fsdp_tp compiled")
    assert_matches(found["lm_adamw_auto"], reference(TinyLM(), lm_data(), lm_loss, "adamw", 16, epochs=2),
                   "fsdp_tp lm_adamw_auto")
    assert_matches(found["lm_resumed"], found["lm_adamw_auto"], "fsdp_tp lm resumed", atol=1e-6)
    assert "; mesh 2 data-parallel (FSDP) × 2 tensor-parallel; tensor-parallel plan: 8 layers split" \
        in found["summary"], found["summary"]
    # a last layer of one row, fewer than the data-parallel ranks: restored by EarlyStopping after 2 epochs to the
    # first epoch's weights, and resumed from the first epoch's checkpoint for a second
    bce = nn.functional.binary_cross_entropy_with_logits
    first = reference(one_output_net(), binary_data(), bce, "adamw", 16, epochs=1)
    assert_matches({**found["restored"], "loss": found["restored"]["loss"][:1]}, first, "fsdp_tp restored 1 row")
    assert len(found["restored"]["loss"]) == 2, found["restored"]["loss"]
    assert_matches(found["resumed"], reference(one_output_net(), binary_data(), bce, "adamw", 16, epochs=2),
                   "fsdp_tp resumed 1 row")


# --- plans, without processes -----------------------------------------------------------


class ReadsWeight(nn.Module):
    """A user's module that uses its child's weight directly: nothing under it may be split."""

    def __init__(self):
        super().__init__()
        self.inner = nn.Linear(4, 4)

    def forward(self, x):
        return x @ self.inner.weight.T


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Dropout(0.0), nn.Linear(8, 4))
        self.odd = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 4))
        self.custom = ReadsWeight()
        self.attention = nn.MultiheadAttention(4, 2, batch_first=True)
        self.padded = nn.Embedding(6, 4, padding_idx=0)
        self.norm = nn.LayerNorm(4)

    def forward(self, x):
        return self.norm(self.custom(self.odd(self.mlp(x))))


def test_auto_plan_splits_what_it_can_prove_and_says_why_the_rest_stays_whole():
    plan = auto_plan(Net(), 2)
    splits = {split.path: split.words() for split in plan.splits}
    assert splits == {"mlp.0": "colwise", "mlp.3": "rowwise", "odd.2": "colwise (output gathered)",
                      "attention": "heads"}
    assert plan.replicated == {
        "odd.0": "its 3 outputs do not divide by 2", "custom.inner": "inside custom, whose ReadsWeight.forward "
        "reads '.weight' itself", "padded": "it has a padding_idx, which needs the whole table",
        "norm": "no split is known for a LayerNorm"}
    lm = auto_plan(TinyLM(), 2)
    assert [(s.path, s.words()) for s in lm.splits][:2] == [("embed", "rowwise"), ("encoder.layers.0.self_attn",
                                                                                     "heads")]
    assert lm.splits[-1].words() == "colwise (output gathered)" and lm.splits[-1].path == "head"   # tied: same rows
    three_heads = auto_plan(nn.Sequential(nn.MultiheadAttention(6, 3)), 2)
    assert three_heads.replicated == {"0": "its 3 heads do not divide by the tensor-parallel size 2"}


@pytest.mark.parametrize("plan, words", [
    ({"mlp.9": "colwise"}, "'mlp.9', which is no module of the net"),
    ({"norm": "colwise"}, "'norm' colwise, but it is a LayerNorm: 'colwise' fits Linear, Embedding only"),
    ({"mlp.0": "diagonal"}, "the style 'diagonal'"),
    ({"attention": "heads"}, "'attention' (MultiheadAttention(4, heads=2)), but its 2 heads do not divide by the "
                             "tensor-parallel size 4"),
    ({"odd.0": "colwise"}, "'odd.0' colwise, but its 3 output features do not divide by the tensor-parallel size 4"),
    ({"odd.2": "rowwise"}, "'odd.2' rowwise, but its 3 input features do not divide by the tensor-parallel size 4"),
    ({"padded": "rowwise"}, "'padded' rowwise, but its 6 rows do not divide by the tensor-parallel size 4"),
])
def test_a_plan_that_does_not_fit_the_net_is_refused_naming_the_module(plan, words):
    with pytest.raises(ValueError, match=words.replace("(", r"\(").replace(")", r"\)")):
        parse_plan(Net(), plan, 4)


def test_a_dict_plan_splitting_sizes_that_do_not_divide_is_refused_before_any_process_starts():
    """15 outputs over 2 ranks: refused by the call's plan, in the caller, not by DTensor in the ranks mid-fit."""
    net = nn.Sequential(nn.Linear(6, 15), nn.ReLU(), nn.Linear(15, 3))
    model = easyfit.Model(net, "mse", "sgd")
    strategy = easyfit.strategies.ModelParallel(plan={"0": "colwise", "2": "rowwise"})
    with pytest.raises(ValueError, match="'0' colwise, but its 15 output features do not divide by the "
                                         "tensor-parallel size 2"):
        model.fit(torch.randn(8, 6), torch.randn(8, 3), devices=2, accelerator="cpu", strategy=strategy, verbose=0)


def test_a_tied_weight_split_two_ways_is_refused():
    with pytest.raises(ValueError, match="one shared \\(tied\\) weight two ways"):
        parse_plan(TinyLM(), {"embed": "colwise", "head": "colwise"}, 2)


def test_a_lone_column_wise_layer_in_a_dict_plan_gathers_its_output_and_a_pair_does_not():
    plan = parse_plan(TinyLM(), SEQUENCE_PLAN, 2)
    words = {split.path: split.words() for split in plan.splits}
    assert words["head"] == "colwise (output gathered)" and words["encoder.layers.0.linear1"] == "colwise"
    assert list(words)[:2] == ["embed", "encoder.layers.0.self_attn"]   # in the net's order, not the dict's


@pytest.mark.parametrize("plan, sequence_parallel, words", [
    (SEQUENCE_PLAN, False, "splits 'encoder.layers.0.norm1', .* along the sequence, which needs "
                           "sequence_parallel=True"),
    ({"embed": "rowwise", "head": "colwise"}, True, "the plan splits nothing along the sequence"),
    ({key: value for key, value in SEQUENCE_PLAN.items() if key != "norm"}, True,
     "'norm' \\(LayerNorm\\) has parameters but is not in the plan"),
])
def test_sequence_parallelism_needs_every_module_with_parameters_in_the_plan(plan, sequence_parallel, words):
    with pytest.raises(ValueError, match=words):
        check_sequence_parallel(TinyLM(), parse_plan(TinyLM(), plan, 2), sequence_parallel)


def test_sequence_parallel_inputs_must_split_evenly_along_the_sequence():
    check_sequence_length(2, None, (torch.zeros(4, 6, dtype=torch.long),), {"mask": torch.ones(4, 6)})
    with pytest.raises(ValueError, match="an input has length 5 \\(shape \\(4, 5\\)\\): pad the sequences to a "
                                         "multiple of 2"):
        check_sequence_length(2, None, (), {"input_ids": torch.zeros(4, 5, dtype=torch.long)})


def test_sequence_parallel_attention_must_be_batch_first():
    net = nn.Sequential(nn.TransformerEncoderLayer(4, 2, 8, dropout=0.0))
    plan = parse_plan(net, {"0": "heads", "0.linear1": "colwise", "0.linear2": "rowwise", "0.norm*": "sequence"}, 2)
    with pytest.raises(ValueError, match="'0.self_attn' has batch_first=False"):
        check_sequence_parallel(net, plan, True)


def test_mesh_sizes_that_do_not_divide_the_processes_are_refused_with_both_numbers():
    assert mesh_shape(4, 4, 2, "auto") == (2, 2) and mesh_shape(8, 4, "auto", "auto") == (2, 4)
    with pytest.raises(ValueError, match="tensor_parallel_size=3 does not divide the 4 processes"):
        mesh_shape(4, 4, 3, "auto")
    with pytest.raises(ValueError, match="data_parallel_size=2 × tensor_parallel_size=4 is 8 processes, but this "
                                         "fit has 4"):
        mesh_shape(4, 4, 4, 2)


def test_errors_come_before_any_process_starts():
    x, y = make_data()
    for strategy, words in ((ModelParallelStrategy(tensor_parallel_size=3), "does not divide the 2 processes"),
                            (ModelParallelStrategy(data_parallel_size=1, plan={"nope": "rowwise"}),
                             "'nope', which is no module"),
                            (ModelParallelStrategy(data_parallel_size=1, loss_parallel=True), "loss_parallel=True")):
        model = easyfit.Model(nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3)), "cross_entropy", "sgd")
        with pytest.raises(ValueError, match=words):
            model.fit(x, y, devices=2, accelerator="cpu", strategy=strategy, verbose=0)
    with pytest.raises(ValueError, match="sequence_parallel=True needs a plan"):
        ModelParallelStrategy(sequence_parallel=True)
