"""Tiny Hugging Face models built from configs (no download), their data as `datasets.Dataset`s, and the plain
PyTorch loop that the easyfit fits are compared with; shared by the one-process tests and hf_train.py."""
from __future__ import annotations

import torch

SAMPLES, LENGTH, VOCAB, LR = 64, 12, 64, 0.1


def make_net(case: str) -> torch.nn.Module:
    """A freshly initialised tiny model, the same on every call: "bert" (a sequence classifier) or "gpt2" (a causal
    language model), dropout off so that a loop and a fit compute the same."""
    import transformers
    torch.manual_seed(0)
    if case == "bert":
        config = transformers.BertConfig(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                         intermediate_size=32, max_position_embeddings=32, num_labels=2,
                                         hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
        return transformers.BertForSequenceClassification(config)
    if case == "gpt2":
        config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=16, n_layer=2, n_head=2,
                                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0,
                                         eos_token_id=0, loss_type="ForCausalLM")
        return transformers.GPT2LMHeadModel(config)
    raise ValueError(case)


def columns(case: str) -> dict[str, torch.Tensor]:
    """The data of a case as columns: token ids, their mask and the targets (a class; for the LM, the ids)."""
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(1, VOCAB, (SAMPLES, LENGTH), generator=generator)
    if case == "gpt2":
        ids[:, 1::2] = (ids[:, 0::2] * 7) % VOCAB   # something to learn: every other token follows from the last
        return {"input_ids": ids, "labels": ids.clone()}
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "label": (ids[:, 0] > VOCAB // 2).long()}


def dataset(case: str):
    import datasets
    return datasets.Dataset.from_dict({key: value.tolist() for key, value in columns(case).items()}
                                      ).with_format("torch")


def plain_loop(case: str, batch_size: int, epochs: int = 2, order: torch.Tensor | None = None
               ) -> tuple[list[float], dict]:
    """SGD over the batches in order (of the samples in `order`, default as they are), the targets passed as
    labels= and the output's loss trained on: (each epoch's sample-weighted mean loss, the weights)."""
    net = make_net(case)
    optimizer = torch.optim.SGD(net.parameters(), lr=LR)
    data = columns(case)
    data["labels"] = data.pop("label", data.get("labels"))
    order = torch.arange(SAMPLES) if order is None else order
    losses = []
    for _ in range(epochs):
        total = 0.0
        for start in range(0, SAMPLES, batch_size):
            rows = order[start:start + batch_size]
            loss = net(**{key: value[rows] for key, value in data.items()}).loss
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            total += float(loss.detach()) * len(rows)
        losses.append(total / SAMPLES)
    return losses, {key: value.clone() for key, value in net.state_dict().items()}
