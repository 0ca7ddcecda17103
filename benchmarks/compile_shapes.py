"""compile= on batches of changing length: easyfit's fit against a hand-written loop over `torch.compile(net)`.

    python benchmarks/compile_shapes.py [--lengths 5-19] [--epochs 3] [--threads 1]

A tiny BERT classifier (transformers' BertForSequenceClassification from a 2-layer, hidden-32 config, returning its
logits), AdamW, 400 token sequences of random lengths in the range, padded per batch of 16 by a collate function in
a DataLoader (the same batches on both sides). Each side runs in a process of its own with an empty inductor cache
(compiling cold), the hand-written loop first; the table gives each side's seconds for the first epoch (which
compiles) and the median of the later ones, and easyfit's ratio to the hand-written loop. Bars: first epoch at most
1.25x, later epochs at most 1.05x. easyfit's count of whole-step training programs (0: a fit whose batches change
size trains in separately compiled parts, with the changing dimensions dynamic) and of all graphs it compiled are
printed.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

BARS = {"first epoch": 1.25, "later epochs": 1.05}


def loader(lengths: tuple[int, int], batch_size: int = 16, count: int = 400):
    import torch
    from torch.nn.utils.rnn import pad_sequence
    from torch.utils.data import DataLoader
    generator = torch.Generator().manual_seed(0)
    samples = []
    for _ in range(count):
        length = int(torch.randint(lengths[0], lengths[1] + 1, (1,), generator=generator))
        ids = torch.randint(1, 500, (length,), generator=generator)
        samples.append((ids, int(ids.sum()) % 2))

    def collate(batch):
        ids, labels = zip(*batch)
        padded = pad_sequence(ids, batch_first=True)
        return padded, (padded != 0).long(), torch.tensor(labels)
    return DataLoader(samples, batch_size=batch_size, collate_fn=collate)


def tiny_bert():
    import torch
    from transformers import BertConfig, BertForSequenceClassification

    class Logits(torch.nn.Module):
        def __init__(self):
            super().__init__()
            config = BertConfig(vocab_size=500, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                intermediate_size=64, max_position_embeddings=128, num_labels=2)
            self.bert = BertForSequenceClassification(config)

        def forward(self, ids, mask):
            return self.bert(input_ids=ids, attention_mask=mask).logits
    torch.manual_seed(0)
    return Logits()


def run_hand(lengths, epochs) -> dict:
    import torch
    net = tiny_bert()
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-3)
    compiled = torch.compile(net)
    times = []
    for _ in range(epochs):
        start = time.perf_counter()
        for ids, mask, labels in loader(lengths):
            optimizer.zero_grad(set_to_none=True)
            loss = torch.nn.functional.cross_entropy(compiled(ids, mask), labels)
            loss.backward()
            optimizer.step()
        times.append(time.perf_counter() - start)
    return {"times": times}


def run_easyfit(lengths, epochs) -> dict:
    import torch

    import easyfit

    class EpochTimes(easyfit.callbacks.Callback):
        def __init__(self):
            self.times = []

        def on_epoch_begin(self, epoch, logs=None):
            self.start = time.perf_counter()

        def on_epoch_end(self, epoch, logs=None):
            self.times.append(time.perf_counter() - self.start)
    clock = EpochTimes()
    model = easyfit.Model(tiny_bert(), "cross_entropy", lambda p: torch.optim.AdamW(p, lr=1e-3))
    model.fit(loader(lengths), epochs=epochs, verbose=0, compile=True, callbacks=[clock])
    programs = [key for value in model.compiled_steps.cache.values() if isinstance(value, dict) for key in value]
    from easyfit.utils.torch_internals import compile_totals
    return {"times": clock.times, "programs": len(programs), "graphs": compile_totals()[0]}


def child(side: str, lengths: tuple[int, int], epochs: int) -> dict:
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": tempfile.mkdtemp(prefix="inductor-")}
    code = (f"import json, sys; sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r}); "
            f"import compile_shapes as c; print(json.dumps(c.run_{side}({lengths!r}, {epochs})))")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"the {side} side failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="5-19", help="shortest-longest sequence length (default 5-19)")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process (default 1)")
    args = parser.parse_args()
    lengths = tuple(int(value) for value in args.lengths.split("-"))
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    results = {side: child(side, lengths, args.epochs) for side in ("hand", "easyfit")}
    hand, ours = results["hand"]["times"], results["easyfit"]["times"]
    rows = {"first epoch": (hand[0], ours[0]),
            "later epochs": (statistics.median(hand[1:]), statistics.median(ours[1:]))}
    print(f"lengths {lengths[0]}-{lengths[1]}, {args.epochs} epochs, {args.threads} thread(s), cold inductor caches")
    print(f"{'':14}{'hand s':>10}{'easyfit s':>11}{'ratio':>8}{'bar':>6}  verdict")
    for name, (theirs, mine) in rows.items():
        ratio = mine / theirs
        print(f"{name:14}{theirs:10.2f}{mine:11.2f}{ratio:8.3f}{BARS[name]:6.2f}  "
              f"{'PASS' if ratio <= BARS[name] else 'FAIL'}")
    print(f"easyfit whole-step training programs: {results['easyfit']['programs']}; graphs compiled (forward with "
          f"loss, optimizer step, evaluation): {results['easyfit']['graphs']}")


if __name__ == "__main__":
    main()
