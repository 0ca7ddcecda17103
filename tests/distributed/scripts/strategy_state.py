"""Two rounds of one short fit per strategy on 2 ranks, one after the other in one launch, each fit recording what
it did to its configured strategy object: every attribute assigned or deleted on it from the call's start on the rank
(before `setup_environment`) to the end of its `teardown`, the attributes added, removed or changed between the two,
the attributes assigned on the user's Model meanwhile, and the sockets it left open (a first fit may open what the
process keeps, the process group of the launch among them; a second fit only what it failed to close).

Usage: python strategy_state.py OUT_DIR STRATEGY [STRATEGY ...]
Each rank writes OUT_DIR/<rank>.pt: {strategy: [per fit {"assigned": [...], "added": [...], "removed": [...],
"changed": [...], "model": [...], "sockets": n}]}.
"""
import contextlib
import gc
import os
import sys

import torch

import easyfit
import easyfit.model

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import make_data, make_net, make_pipeline_net

NETS = {"pipeline": make_pipeline_net}
#: what a call may assign on the user's Model: the running call's one object and what the call leaves the next
#: (`_last_call`), and the documented results: the History, the epochs completed and the position in the epoch (both
#: in its checkpoints), the example `export` traces with, and Keras' `stop_training` (kept in the running call)
MODEL_RESULTS = {"running", "_last_call", "history", "completed_epochs", "position", "_input_example", "stop_training"}


def left_behind(before: dict, after: dict) -> dict:
    """The attributes `after` added, removed or changed (neither the same object nor equal) against `before`."""
    def same(old, new) -> bool:
        try:
            return old is new or bool(old == new)
        except Exception:   # a comparison that does not give one truth value (tensors): not the same
            return False
    return {"added": sorted(set(after) - set(before)), "removed": sorted(set(before) - set(after)),
            "changed": sorted(key for key in set(before) & set(after) if not same(before[key], after[key]))}


def open_sockets() -> set[str] | None:
    """The sockets this process holds open (a process group's connections among them), by their inodes; None where
    /proc is not."""
    if not os.path.isdir("/proc/self/fd"):
        return None
    links = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            links.append(os.readlink(f"/proc/self/fd/{fd}"))
        except FileNotFoundError:   # the listing's own descriptor, closed by now
            pass
    return {link for link in links if link.startswith("socket:")}


@contextlib.contextmanager
def assignments(watched):
    """The names of the attributes set or deleted on the object `watched` while the context runs, in order (its
    class's attribute hooks wrap the ones it had, and are put back)."""
    names, cls = [], type(watched)
    own = {hook: vars(cls)[hook] for hook in ("__setattr__", "__delattr__") if hook in vars(cls)}
    setter, deleter = cls.__setattr__, cls.__delattr__

    def set_attribute(self, name, value):
        if self is watched:
            names.append(name)
        setter(self, name, value)

    def delete_attribute(self, name):
        if self is watched:
            names.append(name)
        deleter(self, name)
    cls.__setattr__, cls.__delattr__ = set_attribute, delete_attribute
    try:
        yield names
    finally:
        for hook in ("__setattr__", "__delattr__"):
            if hook in own:
                setattr(cls, hook, own[hook])
            else:
                delattr(cls, hook)


def recording(call_on_rank, found: dict, key=lambda plan: plan.strategy.name):
    """`call_on_rank` that records each fit's traces, in found[key(plan)] (a list, a record per fit): what it
    assigned on the strategy and left on it (`left_behind`), what it assigned on the Model, and the sockets it left
    open once garbage is collected ("sockets": how many it opened and left open, by inode, so a socket opened before
    the fit and closed meanwhile, by any thread, does not count; None where they cannot be counted). Garbage is
    collected only where a fit's sockets seem left: in a long-lived pytest worker a collection walks a large heap
    (about a second each)."""
    def call(plan, model, **inputs):
        before, sockets = dict(vars(plan.strategy)), open_sockets()
        with assignments(plan.strategy) as assigned, assignments(model) as on_model:
            try:
                return call_on_rank(plan, model, **inputs)
            finally:
                if plan.kind.trains:
                    after = open_sockets()
                    if after and after - sockets:   # open, or only waiting for the collector: collect, count again
                        gc.collect()
                        after = open_sockets()
                    found.setdefault(key(plan), []).append(
                        {"assigned": sorted(set(assigned)), **left_behind(before, dict(vars(plan.strategy))),
                         "model": sorted(set(on_model)), "sockets": None if after is None else len(after - sockets)})
    return call


#: the folder `recorded_call_on_rank` writes each rank's records to (set by the test)
RECORDS_VARIABLE = "EASYFIT_TEST_STRATEGY_RECORDS"


def recorded_call_on_rank(plan, model, **inputs):
    """`call_on_rank` recording its fit (`recording`), each rank's record written to a file of its own in the folder
    RECORDS_VARIABLE names: a function of a module, so a spawn launcher can hand it to the ranks it starts."""
    from easyfit.training.on_rank import call_on_rank
    found: dict = {}
    try:
        return recording(call_on_rank, found)(plan, model, **inputs)
    finally:
        torch.save(found, os.path.join(os.environ[RECORDS_VARIABLE], f"{plan.strategy.global_rank}-{os.getpid()}.pt"))


def main() -> None:
    out, strategies = sys.argv[1], sys.argv[2:]
    torch.set_num_threads(1)
    found: dict = {}
    asked = []   # the name each fit asked for (deepspeed_stage_3's strategy is named "deepspeed")
    easyfit.model.call_on_rank = recording(easyfit.model.call_on_rank, found, key=lambda plan: asked[-1])
    x, y = make_data()
    for strategy in strategies * 2:
        asked.append(strategy)
        model = easyfit.Model(NETS.get(strategy, make_net)(), "cross_entropy", "adam")
        model.fit(x, y, batch_size=32, epochs=1, verbose=0, devices=2, accelerator="cpu", strategy=strategy,
                  validation_split=0.25)
    torch.save(found, os.path.join(out, f"{int(os.environ.get('RANK', 0))}.pt"))


if __name__ == "__main__":
    main()
