"""Text classification the Hugging Face way, trained from scratch in well under a minute on a CPU: a tokenizer
trained here (the `tokenizers` package), a `datasets.Dataset`, transformers' padding collator, a small
BertForSequenceClassification built from a config (no download), and easyfit's fit with loss="model" (the labels go
into the forward; the net trains on the loss it returns).

The text is the topics of Python's own documentation, which ship with Python (`pydoc_data.topics`): each paragraph
of four topics is labelled with its topic, and the net learns which topic a paragraph comes from.

Run:  pip install -e ".[hf]" && python examples/finetune_text.py
Prints the test accuracy (about 0.8; chance is 0.25) and exits with status 1 if it is below 0.6.
"""
from __future__ import annotations

import random
import re
import sys
from pydoc_data.topics import topics

import torch
from datasets import Dataset
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers
from transformers import BertConfig, BertForSequenceClassification, DataCollatorWithPadding, PreTrainedTokenizerFast

import easyfit

TOPICS = ["compound", "specialnames", "string-methods", "debugger"]   # statements, data model, str, pdb
TARGET_ACCURACY = 0.6
MAX_TOKENS = 64


def paragraphs() -> tuple[list[dict], list[dict]]:
    """(train, test) rows {"text", "label"}: the paragraphs of at least 8 words of each topic, split 80 / 20."""
    rows = [{"text": " ".join(paragraph.split()), "label": label}
            for label, topic in enumerate(TOPICS)
            for paragraph in re.split(r"\n\s*\n", topics[topic]) if len(paragraph.split()) >= 8]
    random.Random(0).shuffle(rows)
    cut = int(len(rows) * 0.8)
    return rows[:cut], rows[cut:]


def train_tokenizer(texts: list[str]) -> PreTrainedTokenizerFast:
    """A WordPiece tokenizer of 2000 tokens learnt from the training texts, wrapped for transformers."""
    tokenizer = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tokenizer.normalizer = normalizers.BertNormalizer(lowercase=True)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.train_from_iterator(texts, trainers.WordPieceTrainer(vocab_size=2000, special_tokens=["[PAD]", "[UNK]"]))
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="[PAD]", unk_token="[UNK]")


def tokenized(rows: list[dict], tokenizer) -> Dataset:
    """A datasets.Dataset of token ids (of each paragraph's own length, at most MAX_TOKENS) and labels."""
    dataset = Dataset.from_list(rows)
    return dataset.map(lambda batch: tokenizer(batch["text"], truncation=True, max_length=MAX_TOKENS),
                       batched=True, remove_columns=["text"])


def main() -> int:
    torch.manual_seed(0)
    train_rows, test_rows = paragraphs()
    tokenizer = train_tokenizer([row["text"] for row in train_rows])
    train, test = tokenized(train_rows, tokenizer), tokenized(test_rows, tokenizer)
    config = BertConfig(vocab_size=tokenizer.vocab_size, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=128, max_position_embeddings=MAX_TOKENS, num_labels=len(TOPICS))
    net = BertForSequenceClassification(config)
    collator = DataCollatorWithPadding(tokenizer)   # pads each batch to its longest paragraph

    model = easyfit.Model(net, "model", "adamw", metrics=["accuracy"], lr=2e-3, weight_decay=0.01)
    model.fit(train, epochs=8, batch_size=32, collate_fn=collator, verbose=2)
    scores = model.evaluate(test, collate_fn=collator, verbose=0, return_dict=True)

    print(f"{len(train)} training and {len(test)} test paragraphs of {len(TOPICS)} topics (chance: "
          f"{1 / len(TOPICS):.2f})")
    print(f"test accuracy: {scores['accuracy']:.4f}")
    if scores["accuracy"] < TARGET_ACCURACY:
        print(f"below the target accuracy {TARGET_ACCURACY}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
