"""Tiny Hugging Face models trained by one easyfit fit with loss="model" on a `datasets.Dataset`, as a real program
on several processes.

Usage: python hf_train.py OUT_DIR STRATEGY:CASE[,STRATEGY:CASE...]   (CASE: bert, gpt2, stream)
The fits run one after the other in the same 2 ranks. Rank 0 writes OUT_DIR/result.pt: {(strategy, case): weights,
history, evaluate() scores, predict() logits}. "stream" trains bert on the dataset as a Hugging Face IterableDataset
of 2 shards (no evaluation); each rank writes OUT_DIR/stream-<rank>.txt: how many batches it trained.
"""
import os
import sys

import torch

import easyfit
import easyfit.callbacks

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from hf_common import LR, dataset, make_net


class BatchCount(easyfit.callbacks.Callback):
    """Writes how many training batches this rank ran (OUT_DIR/stream-<rank>.txt)."""

    def __init__(self):
        self.batches = 0

    def on_train_batch_end(self, batch, logs=None):
        self.batches += 1

    def on_train_end(self, logs=None):
        with open(os.path.join(sys.argv[1], f"stream-{self.model.global_rank}.txt"), "w") as file:
            file.write(str(self.batches))


def main() -> None:
    out, runs = sys.argv[1], [tuple(run.split(":")) for run in sys.argv[2].split(",")]
    torch.set_num_threads(1)
    results = {}
    for strategy, case in runs:
        run = dict(devices=2, accelerator="cpu", strategy=strategy)
        stream = case == "stream"
        net, data = make_net("bert" if stream else case), dataset("bert" if stream else case)
        model = easyfit.Model(net, "model", "sgd", lr=LR, metrics=["accuracy"] if case != "gpt2" else None)
        if stream:
            counted = BatchCount()
            history = model.fit(data.to_iterable_dataset(num_shards=2), batch_size=8, epochs=2, verbose=0,
                                lr_scaling=None, callbacks=[counted], **run)
            results[strategy, case] = {"state": {key: value.clone() for key, value in net.state_dict().items()},
                                       "history": history.history}
            continue
        history = model.fit(data, batch_size=8, epochs=2, shuffle=False, verbose=0, lr_scaling=None, **run)
        scores = model.evaluate(data, batch_size=8, verbose=0, return_dict=True, **run)
        predictions = model.predict(data, batch_size=8, **run)
        results[strategy, case] = {"state": {key: value.clone() for key, value in net.state_dict().items()},
                                   "history": history.history, "scores": scores, "predictions": predictions,
                                   "world_size": history.params["world_size"]}
    if model.is_global_zero:
        torch.save(results, os.path.join(out, "result.pt"))


if __name__ == "__main__":
    main()
