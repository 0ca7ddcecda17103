"""Losses over counted items (tokens) against plain PyTorch on the combined batch of each optimizer step.

Usage: python item_counts.py OUT_DIR SEED DRAWS STRATEGY [STRATEGY ...]
On 2 ranks under each strategy: the transformers probes (a causal LM, a masked LM, a token classifier; one step of 8
sequences, accumulation 1 and 2) and DRAWS drawn token cases (seeded by SEED; the first compiled under ddp and fsdp);
under ddp_spawn, whose every fit starts its ranks anew, the causal LM's probes only. Rank 0 writes OUT_DIR/result.pt:
{strategy: {case name: differences (weights, epoch loss[, evaluate's loss])}}. The single-process tests import the
cases from here. Module-level functions only: a spawned rank unpickles them."""
import functools
import os
import random
import sys

import torch
from torch import nn
from torch.nn import functional as F

import easyfit

T, VOCAB, LR = 6, 11, 0.5
PATTERNS = ("uniform", "long_and_short", "some_empty")
LOSSES = ("cross_entropy", "module", "partial")


def loss_of(name: str):
    """The loss as a user gives it: by name, torch's module with ignore_index, an F.cross_entropy partial."""
    return {"cross_entropy": "cross_entropy", "module": nn.CrossEntropyLoss(ignore_index=-100),
            "partial": functools.partial(F.cross_entropy, ignore_index=-100)}[name]


class TokenNet(nn.Module):
    """Logits (batch, vocab, time) for targets (batch, time)."""

    def __init__(self):
        super().__init__()
        self.embed, self.out = nn.Embedding(VOCAB, 8), nn.Linear(8, VOCAB)

    def forward(self, x):
        return self.out(torch.tanh(self.embed(x))).transpose(1, 2)


def new_token_net() -> nn.Module:
    torch.manual_seed(5)
    return TokenNet()


def draw(seed: int, count: int, ranks: tuple = (1, 2), strategies: tuple = ("ddp",), compiles: bool = True) -> list:
    """`count` drawn token cases: padding pattern, accumulation 1-4, ranks, strategy, compile= on or off, loss."""
    rng = random.Random(seed)
    return [{"seed": rng.randrange(10 ** 6), "pattern": rng.choice(PATTERNS), "accumulate": rng.randint(1, 4),
             "batch": rng.randint(1, 3), "steps": rng.randint(1, 3), "ranks": rng.choice(ranks),
             "strategy": rng.choice(strategies), "compile": compiles and rng.random() < 0.3,
             "loss": rng.choice(LOSSES)} for _ in range(count)]


def token_data(case: dict) -> tuple:
    """Sequences of the step's combined batches, padded (-100) by the case's pattern; every step has an item."""
    generator = torch.Generator().manual_seed(case["seed"])
    per_step = case["batch"] * case["accumulate"] * case["ranks"]
    n = per_step * case["steps"]
    x = torch.randint(0, VOCAB, (n, T), generator=generator)
    y = torch.randint(0, VOCAB, (n, T), generator=generator)
    if case["pattern"] == "uniform":
        lengths = torch.randint(0, T + 1, (n,), generator=generator)
    elif case["pattern"] == "long_and_short":
        lengths = torch.where(torch.rand(n, generator=generator) < 0.5, T, 1)
    else:
        lengths = torch.where(torch.rand(n, generator=generator) < 0.5, T, 0)
    lengths[::per_step] = lengths[::per_step].clamp(min=1)
    y[torch.arange(T) >= lengths[:, None]] = -100
    return x, y


def fit_tokens(case: dict, loss=None) -> tuple:
    """(weights, epoch loss, evaluate's loss) after easyfit's fit of the case (`loss`: in place of the case's)."""
    net = new_token_net()
    model = easyfit.Model(net, loss=loss or loss_of(case["loss"]), optimizer=functools.partial(torch.optim.SGD, lr=LR))
    x, y = token_data(case)
    where = {} if case["ranks"] == 1 else {"devices": case["ranks"], "accelerator": "cpu",
                                           "strategy": case["strategy"]}
    history = model.fit(x, y, epochs=1, batch_size=case["batch"], shuffle=False, verbose=0, lr_scaling=None,
                        gradient_accumulation_steps=case["accumulate"], compile=case["compile"], **where)
    weights = [p.detach().clone() for p in net.parameters()]
    return weights, history.history["loss"][0], model.evaluate(x, y, batch_size=case["batch"], verbose=0, **where)


def plain_tokens(case: dict) -> tuple:
    """(weights, epoch loss, loss over all the data after) of plain PyTorch, one SGD step per combined batch; the
    epoch loss is the sum over its items over their number."""
    net = new_token_net()
    optimizer = torch.optim.SGD(net.parameters(), lr=LR)
    x, y = token_data(case)
    per_step = case["batch"] * case["accumulate"] * case["ranks"]
    total, items = 0.0, 0
    for start in range(0, len(x), per_step):
        xb, yb = x[start:start + per_step], y[start:start + per_step]
        optimizer.zero_grad()
        loss = F.cross_entropy(net(xb), yb, ignore_index=-100)
        loss.backward()
        optimizer.step()
        total, items = total + loss.item() * int((yb != -100).sum()), items + int((yb != -100).sum())
    with torch.no_grad():
        evaluated = F.cross_entropy(net(x), y, ignore_index=-100).item()
    return [p.detach() for p in net.parameters()], total / items, evaluated


def difference(fitted: tuple, plain: tuple) -> tuple:
    """(largest weight difference, then the difference of each loss)."""
    weights = max(float((a - b).abs().max()) for a, b in zip(fitted[0], plain[0]))
    return (weights, *(abs(a - b) for a, b in zip(fitted[1:], plain[1:])))


# --- the transformers probes ------------------------------------------------------------------
HF_KINDS = ("causal_lm", "masked_lm", "token_classifier")


def new_hf_model(kind: str) -> nn.Module:
    from transformers import BertConfig, BertForMaskedLM, BertForTokenClassification, GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    if kind == "causal_lm":
        return GPT2LMHeadModel(GPT2Config(vocab_size=50, n_positions=16, n_embd=16, n_layer=1, n_head=2,
                                          resid_pdrop=0, embd_pdrop=0, attn_pdrop=0, bos_token_id=0,
                                          eos_token_id=0))
    config = BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=32, max_position_embeddings=16, hidden_dropout_prob=0,
                        attention_probs_dropout_prob=0, num_labels=3)
    return BertForMaskedLM(config) if kind == "masked_lm" else BertForTokenClassification(config)


#: the sequences with 11 real tokens (the others have 2): every split of the 8 (micro-batches of 4 or 2, ranks taking
#: every other one, both) gives its parts different numbers of tokens
LONG_ROWS = (0, 1, 2, 4)


def hf_rows(kind: str) -> dict:
    """8 sequences of 12 tokens: 4 with 11 real tokens (labelled), 4 with 2 (`LONG_ROWS`)."""
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 50, (8, 12), generator=generator)
    labels = ids.clone() if kind != "token_classifier" else torch.randint(0, 3, (8, 12), generator=generator)
    for row in range(8):
        labels[row, 11 if row in LONG_ROWS else 2:] = -100
    return {"input_ids": ids, "labels": labels}


def fit_hf(kind: str, accumulate: int, strategy: str = "single", ranks: int = 1) -> tuple:
    """(weights, epoch loss) after one optimizer step over the 8 sequences, from a datasets.Dataset, loss="model"."""
    from datasets import Dataset
    net = new_hf_model(kind)
    rows = hf_rows(kind)
    data = Dataset.from_dict({key: value.tolist() for key, value in rows.items()}).with_format("torch")
    model = easyfit.Model(net, loss="model", optimizer=functools.partial(torch.optim.SGD, lr=LR))
    where = {} if ranks == 1 else {"devices": ranks, "accelerator": "cpu", "strategy": strategy}
    history = model.fit(data, epochs=1, batch_size=8 // (accumulate * ranks), shuffle=False, verbose=0,
                        lr_scaling=None, gradient_accumulation_steps=accumulate, **where)
    return [p.detach().clone() for p in net.parameters()], history.history["loss"][0]


def plain_hf(kind: str) -> tuple:
    net = new_hf_model(kind)
    optimizer = torch.optim.SGD(net.parameters(), lr=LR)
    loss = net(**hf_rows(kind)).loss
    loss.backward()
    optimizer.step()
    return [p.detach() for p in net.parameters()], loss.item()


def main() -> None:
    out, seed, draws, strategies = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4:]
    result = {}
    for strategy in strategies:
        spawns = strategy == "ddp_spawn"   # each fit starts its ranks: DDP's step, checked under ddp
        found = {f"{kind} accumulate {accumulate}": difference(fit_hf(kind, accumulate, strategy, 2), plain_hf(kind))
                 for kind in (HF_KINDS[:1] if spawns else HF_KINDS) for accumulate in (1, 2)}
        compiles = strategy in ("ddp", "fsdp")   # DeepSpeed's engine builds its own step
        cases = [] if spawns else draw(seed, draws, ranks=(2,), strategies=(strategy,), compiles=compiles)
        for case in cases[:1]:
            case["compile"] = compiles
        for case in cases:
            found[repr(case)] = difference(fit_tokens(case), plain_tokens(case))
        result[strategy] = found
    if int(os.environ.get("RANK", 0)) == 0:
        torch.save(result, os.path.join(out, "result.pt"))


if __name__ == "__main__":
    main()
