"""Common script patterns run on 2 CPU processes by test_agreement.py: each rank records what it saw.

Usage: python patterns.py OUT_DIR SCENARIO
Each rank writes OUT_DIR/rank-<global rank>.json; a rank that records an error writes it under "error". SCENARIO
"agreeing" runs the scenarios that end well (AGREEING) in one launch and records each one's values under its name;
before its first call it reads a line of standard input and changes into the folder "sub" (relative), as scripts do,
and records what each rank read and where it ran.
"""
import json
import os
import sys
import time
from datetime import timedelta

import torch

SCENARIO = sys.argv[2]
OUT = os.path.abspath(sys.argv[1])
if SCENARIO == "exit_before_call" and os.environ.get("LOCAL_RANK") == "1":
    sys.exit(0)   # a re-run rank that leaves quietly before its first call

import easyfit
from easyfit.callbacks import Callback, EarlyStopping

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import make_data, make_net

CPU2 = {"devices": 2, "accelerator": "cpu"}


def record(model, **values) -> None:
    with open(os.path.join(OUT, f"rank-{model.global_rank}.json"), "w") as file:
        json.dump(values, file)


class OnRank(Callback):
    """On one rank at one step: stop training, raise, exit, or hang."""

    def __init__(self, rank: int, step: int, action: str):
        self.rank, self.step, self.action, self.steps_seen = rank, step, action, 0

    def on_train_batch_end(self, batch, logs=None):
        self.steps_seen += 1
        if self.model.global_rank != self.rank or batch != self.step:
            return
        if self.action == "stop":
            self.model.stop_training = True
        elif self.action == "raise":
            raise RuntimeError(f"deliberate failure on rank {self.rank}")
        elif self.action == "exit":
            sys.exit(0)
        elif self.action == "hang":
            time.sleep(3600)


def new_model() -> easyfit.Model:
    return easyfit.Model(make_net(), "cross_entropy", "sgd", metrics=["accuracy"], lr=0.05)


def evaluate_after_fit(model, x, y) -> dict:
    model.fit(x, y, epochs=1, batch_size=16, verbose=0, strategy="ddp", **CPU2)
    scores = model.evaluate(x, y, verbose=0)
    return {"scores": scores, "predictions": list(model.predict(x).shape), "world_size": model.world_size}


def single_among_ranks(model, x, y) -> dict:
    model.fit(x, y, epochs=1, batch_size=16, verbose=0, strategy="ddp", **CPU2)
    model.evaluate(x, y, verbose=0, strategy="single", accelerator="cpu")
    if model.is_global_zero:
        model.save(os.path.join(OUT, f"saved-by-pid-{os.getpid()}.pt"))
    return {"identity": (model.global_rank, model.world_size)}


def stop_on_one_rank(model, x, y) -> dict:
    callback = OnRank(rank=1, step=2, action="stop")
    model.fit(x, y, epochs=5, batch_size=16, verbose=0, callbacks=[callback], strategy="ddp", **CPU2)
    return {"steps": callback.steps_seen, "epochs": model.completed_epochs}


def predict_one_sample(model, x, y) -> dict:
    model.fit(x, y, epochs=1, batch_size=16, verbose=0, strategy="ddp", **CPU2)
    return {"shape": list(model.predict(x[:1], strategy="ddp", **CPU2).shape)}


def uneven_iterable(model, x, y) -> dict:
    rank = int(os.environ.get("LOCAL_RANK", 0))
    batches = [(x[i:i + 16], y[i:i + 16]) for i in range(0, 16 * (6 - rank), 16)]   # 6 and 5 batches

    class Shard(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(batches)

    model.fit(torch.utils.data.DataLoader(Shard(), batch_size=None), epochs=2, verbose=0, strategy="ddp", **CPU2)
    return {"weights": [float(p.sum()) for p in model.net.parameters()]}


#: the scenarios that end well on every rank: "agreeing" runs them one after the other in one launch, each on a new
#: Model, as a script that trains several models does (starting the processes is what costs time)
AGREEING = {scenario.__name__: scenario for scenario in (evaluate_after_fit, single_among_ranks, stop_on_one_rank,
                                                         predict_one_sample, uneven_iterable)}


def main() -> None:
    torch.set_num_threads(1)
    if SCENARIO == "early_launch":
        easyfit.launch(**CPU2)
    if SCENARIO == "agreeing":
        try:
            answer = input()   # a re-run rank must get end-of-file at once, not wait for a terminal
        except EOFError:
            answer = "eof"
        os.chdir("sub")   # relative: every rank must start where the script was started
    x, y = make_data()
    model = new_model()
    if SCENARIO == "early_launch":
        identity = (model.global_rank, model.world_size)   # before any fit
        model.fit(x, y, epochs=1, batch_size=16, verbose=0, **CPU2)
        record(model, identity=identity)
    elif SCENARIO == "agreeing":
        found = {name: scenario(new_model(), x, y) for name, scenario in AGREEING.items()}
        record(model, **found, answer=answer, cwd=os.getcwd())
    elif SCENARIO == "uneven":
        rank = int(os.environ.get("LOCAL_RANK", 0))
        model.fit(x[:len(x) - 40 * rank], y[:len(y) - 40 * rank], epochs=1, batch_size=16, verbose=0,
                  strategy="ddp", **CPU2)
    elif SCENARIO in ("catch_and_continue", "exit_in_callback"):
        action = "raise" if SCENARIO == "catch_and_continue" else "exit"
        try:
            model.fit(x, y, epochs=3, batch_size=16, verbose=0, callbacks=[OnRank(1, 2, action)], strategy="ddp",
                      **CPU2)
            record(model, error=None)
        except Exception as error:   # the user's handler: the rank goes on and ends normally
            record(model, error=str(error))
    elif SCENARIO == "only_rank_zero_calls":
        model.fit(x, y, epochs=1, batch_size=16, verbose=0, strategy="ddp", **CPU2)
        if model.is_global_zero:
            model.evaluate(x, y, verbose=0, strategy="ddp", **CPU2)
    elif SCENARIO == "exit_before_call":
        model.fit(x, y, epochs=1, batch_size=16, verbose=0, strategy="ddp", **CPU2)
    elif SCENARIO == "spawn_callbacks":
        stopping = EarlyStopping(monitor="loss", patience=0, min_delta=100.0)
        model.fit(x, y, epochs=5, batch_size=16, verbose=0, callbacks=[stopping], strategy="ddp_spawn", **CPU2)
        record(model, stopped_epoch=stopping.stopped_epoch, epochs=len(model.history.epoch))
    elif SCENARIO == "fork_lambda_loss":
        class LocalNet(torch.nn.Module):   # defined in a function: fork needs no pickling of it
            def __init__(self):
                super().__init__()
                self.layer = make_net()

            def forward(self, inputs):
                return self.layer(inputs)

        model = easyfit.Model(LocalNet(), lambda output, target: torch.nn.functional.cross_entropy(output, target),
                              "sgd", lr=0.05)
        history = model.fit(x, y, epochs=2, batch_size=16, verbose=0, strategy="ddp_fork", **CPU2)
        record(model, epochs=len(history.history["loss"]))
    elif SCENARIO == "stuck":
        strategy = easyfit.strategies.DDP(start_method="spawn", timeout=timedelta(seconds=5))
        model.fit(x, y, epochs=3, batch_size=16, verbose=0, callbacks=[OnRank(1, 2, "hang")], strategy=strategy,
                  **CPU2)
    else:
        raise SystemExit(f"unknown scenario {SCENARIO!r}")


if __name__ == "__main__":
    main()
