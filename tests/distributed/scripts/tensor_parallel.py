"""Tensor and 2-D parallelism as a real program: many fits per launch, their results in one file per rank.

Usage: python tensor_parallel.py OUT_DIR SUITE
SUITE "tp" runs on 2 processes (tensor parallel only), "fsdp_tp" on 4 (2 data-parallel × 2 tensor-parallel,
TP_DEVICES=4 in the environment). Each case trains from the same start as tests/distributed/test_tensor_parallel.py's
plain PyTorch reference and records the weights after fit and the History's losses. The "tp" suite also trains in
bf16-mixed, compiled (compile=True: inductor; the LM with aot_eager), compiles under "fsdp" (2 data-parallel ranks,
inductor), reads model.summary() inside a fit, validates with hand_back=False (the sharded net itself, nothing
gathered), saves, resumes (a full file and a DCP folder), evaluates and predicts; "fsdp_tp" resumes the LM from a full
file and also compiles under "fsdp_tp". Each rank writes OUT_DIR/<rank>.pt.
"""
import os
import sys

import torch
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import easyfit
from easyfit.callbacks import Callback, EarlyStopping, ModelCheckpoint
from easyfit.distributed.environments import launch_identity
from easyfit.distributed.strategy_parts.tp_auto import auto_plan

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import make_data, make_net

VOCAB, DIM, LENGTH = 16, 8, 6


class TinyLM(nn.Module):
    """An embedding, two transformer encoder layers and an output layer tied to the embedding (benchmarks/tp_memory.py
    builds a larger one)."""

    def __init__(self, vocab: int = VOCAB, dim: int = DIM, heads: int = 2, feedforward: int = 16):
        super().__init__()
        torch.manual_seed(2)
        self.embed = nn.Embedding(vocab, dim)
        # no biases: a key bias gets a gradient of zero (softmax ignores it) plus rounding noise, which AdamW
        # would blow up into steps of lr either way, in plain PyTorch as under TP
        layer = nn.TransformerEncoderLayer(dim, heads, feedforward, dropout=0.0, activation="gelu", batch_first=True,
                                           bias=False)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(dim, bias=False)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens):
        return self.head(self.norm(self.encoder(self.embed(tokens))))


def lm_data():
    generator = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, VOCAB, (64, LENGTH + 1), generator=generator)
    return tokens[:, :-1], tokens[:, 1:]


def lm_loss(output, target):
    """Cross-entropy over every position: the classes on dim 1."""
    return nn.functional.cross_entropy(output.transpose(1, 2), target)


#: TinyLM split along the sequence between its split layers: the norms run on each rank's part of the sequence
SEQUENCE_PLAN = {"embed": "rowwise", "encoder.layers.*.self_attn": "heads", "encoder.layers.*.linear1": "colwise",
                 "encoder.layers.*.linear2": "rowwise", "encoder.layers.*.norm*": "sequence", "norm": "sequence",
                 "head": "colwise"}


def callable_plan(net, mesh):
    parallelize_module(net, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})


OPTIMIZERS = {"sgd": lambda params: torch.optim.SGD(params, lr=0.1),
              "adamw": lambda params: torch.optim.AdamW(params, lr=0.01, weight_decay=0.1)}


def fit(strategy, net, data, loss, optimizer: str, batch_size: int, **options) -> easyfit.Model:
    model = easyfit.Model(net, loss, OPTIMIZERS[optimizer](net.parameters()))
    model.fit(*data, batch_size=batch_size, shuffle=False, verbose=0, lr_scaling=None, accelerator="cpu",
              devices=int(os.environ.get("TP_DEVICES", "2")), strategy=strategy, **{"epochs": 3, **options})
    return model


def outcome(model: easyfit.Model) -> dict:
    return {"weights": {k: v.clone() for k, v in model.net.state_dict().items()},
            "loss": list(model.history.history["loss"])}


class SummaryInFit(Callback):
    """model.summary() as a callback sees it inside the fit: the sharded net, each parameter's piece on this rank."""

    def on_train_begin(self, logs=None):
        self.text = self.model.summary(print_fn=None)


def tp(**options):
    return easyfit.strategies.ModelParallel(data_parallel_size=1, **options)


def tp_suite(out: str) -> dict:
    mlp, lm = make_data(), lm_data()
    summary = SummaryInFit()
    results = {
        "mlp_sgd_auto": outcome(fit("tp", make_net(), mlp, "cross_entropy", "sgd", 32, callbacks=[summary])),
        "mlp_sgd_bf16": outcome(fit("tp", make_net(), mlp, "cross_entropy", "sgd", 32, precision="bf16-mixed")),
        "mlp_adamw_dict_clip": outcome(fit(tp(plan={"0": "colwise", "2": "rowwise"}), make_net(), mlp,
                                           "cross_entropy", "adamw", 16, gradient_accumulation_steps=2,
                                           gradient_clip_val=0.5)),
        "mlp_sgd_callable": outcome(fit(tp(plan=callable_plan), make_net(), mlp, "cross_entropy", "sgd", 32)),
        "lm_adamw_auto": outcome(fit("tp", TinyLM(), lm, lm_loss, "adamw", 16, epochs=2)),
        "lm_adamw_sequence": outcome(fit(tp(plan=SEQUENCE_PLAN, sequence_parallel=True), TinyLM(), lm, lm_loss,
                                         "adamw", 16, epochs=2)),
        "mlp_adamw_compiled": outcome(fit("tp", make_net(), mlp, "cross_entropy", "adamw", 16, compile=True)),
        "lm_adamw_compiled": outcome(fit("tp", TinyLM(), lm, lm_loss, "adamw", 16, epochs=2,
                                         compile={"backend": "aot_eager"})),
        # FSDP2 (data parallel, 2 ranks of 8 samples) compiled with inductor: 2 ranks compile where the 4 of the
        # "fsdp_tp" suite would compile the same programs 4 times on the same cores
        "mlp_adamw_fsdp_compiled": outcome(fit("fsdp", make_net(), mlp, "cross_entropy", "adamw", 8, compile=True)),
    }
    from torch._dynamo.utils import counters
    results["graphs_compiled"] = counters["stats"]["unique_graphs"]
    parallel = fit(tp(loss_parallel=True), TinyLM(), lm, lm_loss, "adamw", 16, epochs=2)
    results["lm_adamw_loss_parallel"] = outcome(parallel)
    results["lm_summary"] = parallel.history.params["summary"]
    results["summary_in_fit"] = summary.text
    results["lm_plan"] = auto_plan(TinyLM(), 2).describe(TinyLM())
    results["evaluate"] = {"scores": parallel.evaluate(*lm, batch_size=5, verbose=0, return_dict=True,
                                                       strategy="tp", devices=2, accelerator="cpu"),
                           "predictions": parallel.predict(lm[0], batch_size=5, strategy="tp", devices=2,
                                                           accelerator="cpu")}
    results["checkpoint"] = checkpoints(out, mlp)
    results["kept_val_loss"], results["handed_back_val_loss"] = (
        fit(tp(hand_back=hand_back), make_net(), mlp, "cross_entropy", "sgd", 32, epochs=2,
            validation_data=(mlp[0][:5], mlp[1][:5])).history.history["val_loss"] for hand_back in (False, True))
    return results


def checkpoints(out: str, data) -> dict:
    """4 epochs straight with a full checkpoint and a DCP folder after each; resumed from epoch 2 of each."""
    full, folder = os.path.join(out, "full-{epoch}.pt"), os.path.join(out, "dcp-{epoch}")
    straight = fit("tp", make_net(), data, "cross_entropy", "adamw", 32, epochs=4,
                   callbacks=[ModelCheckpoint(full, monitor="loss")])
    saved = os.path.join(out, "saved.pt")
    if straight.is_global_zero:
        torch.save(straight.net.state_dict(), saved)
    fit(tp(state_dict_type="sharded"), make_net(), data, "cross_entropy", "adamw", 32, epochs=2,
        callbacks=[ModelCheckpoint(folder, monitor="loss")])
    from_file = fit("tp", make_net(), data, "cross_entropy", "adamw", 32, epochs=4, resume_from=full.format(epoch=2))
    from_folder = fit(tp(state_dict_type="sharded"), make_net(), data, "cross_entropy", "adamw", 32, epochs=4,
                      resume_from=folder.format(epoch=2))
    return {"straight": outcome(straight), "from_file": outcome(from_file), "from_folder": outcome(from_folder),
            "saved": saved, "predictions": straight.predict(data[0], strategy="tp", devices=2, accelerator="cpu")}


def one_output_net() -> nn.Module:
    """A last layer of one row: fewer rows than the 2 data-parallel ranks that shard it."""
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(6, 4), nn.Tanh(), nn.Linear(4, 1))


def binary_data():
    x, y = make_data()
    return x, (y > 0).float()[:, None]


def restored_small_layers(out: str) -> dict:
    """EarlyStopping(restore_best_weights=True) and resume_from into a net whose last layer has one row: the best
    epoch is the first (mode "max" on the loss), so the fit stops after the second and restores the first; then a
    fit resumed from the first epoch's checkpoint trains the second."""
    pattern = os.path.join(out, "one-output-{epoch}.pt")
    stopped = fit("fsdp_tp", one_output_net(), binary_data(), "bce_with_logits", "adamw", 8, epochs=3,
                  callbacks=[EarlyStopping(monitor="loss", mode="max", restore_best_weights=True),
                             ModelCheckpoint(pattern, monitor="loss")])
    resumed = fit("fsdp_tp", one_output_net(), binary_data(), "bce_with_logits", "adamw", 8, epochs=2,
                  resume_from=pattern.format(epoch=1))
    return {"restored": outcome(stopped), "resumed": outcome(resumed)}


def fsdp_tp_suite(out: str) -> dict:
    mlp, lm = make_data(), lm_data()
    pattern = os.path.join(out, "lm-{epoch}.pt")
    lm_fit = fit("fsdp_tp", TinyLM(), lm, lm_loss, "adamw", 8, epochs=2,
                 callbacks=[ModelCheckpoint(pattern, monitor="loss")])
    resumed = fit("fsdp_tp", TinyLM(), lm, lm_loss, "adamw", 8, epochs=2, resume_from=pattern.format(epoch=1))
    return {"mlp_sgd_auto": outcome(fit("fsdp_tp", make_net(), mlp, "cross_entropy", "sgd", 16)),
            "mlp_sgd_callable": outcome(fit(easyfit.strategies.ModelParallel(tensor_parallel_size=2,
                                                                             plan=callable_plan),
                                            make_net(), mlp, "cross_entropy", "sgd", 16)),
            "mlp_sgd_compiled": outcome(fit("fsdp_tp", make_net(), mlp, "cross_entropy", "sgd", 16,
                                            compile={"backend": "aot_eager"})),
            "mlp_adamw_dict_clip": outcome(fit(
                easyfit.strategies.ModelParallel(tensor_parallel_size=2, plan={"0": "colwise", "2": "rowwise"}),
                make_net(), mlp, "cross_entropy", "adamw", 8, gradient_accumulation_steps=2, gradient_clip_val=0.5)),
            "lm_adamw_auto": outcome(lm_fit), "lm_resumed": outcome(resumed),
            "summary": lm_fit.history.params["summary"], **restored_small_layers(out)}


def main() -> None:
    out, suite = sys.argv[1], sys.argv[2]
    torch.set_num_threads(1)
    results = tp_suite(out) if suite == "tp" else fsdp_tp_suite(out)
    torch.save(results, os.path.join(out, f"{launch_identity()[0]}.pt"))


if __name__ == "__main__":
    main()
