"""One short fit per strategy on 2 ranks, one after the other in one launch, each recording what the fit left on its
configured strategy object: the attributes added, removed or changed between the call's start on the rank (before
`setup_environment`) and the end of its `teardown`.

Usage: python strategy_state.py OUT_DIR STRATEGY [STRATEGY ...]
Each rank writes OUT_DIR/<rank>.pt: {strategy: {"added": [...], "removed": [...], "changed": [...]}}.
"""
import os
import sys

import torch

import easyfit
import easyfit.model

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import make_data, make_net, make_pipeline_net

NETS = {"pipeline": make_pipeline_net}


def left_behind(before: dict, after: dict) -> dict:
    """The attributes `after` added, removed or changed (neither the same object nor equal) against `before`."""
    def same(old, new) -> bool:
        try:
            return old is new or bool(old == new)
        except Exception:   # a comparison that does not give one truth value (tensors): not the same
            return False
    return {"added": sorted(set(after) - set(before)), "removed": sorted(set(before) - set(after)),
            "changed": sorted(key for key in set(before) & set(after) if not same(before[key], after[key]))}


def recording(call_on_rank, found: dict):
    """`call_on_rank` that records, per fit, what it left on the strategy (`left_behind`)."""
    def call(plan, model, **inputs):
        before = dict(vars(plan.strategy))
        try:
            return call_on_rank(plan, model, **inputs)
        finally:
            if plan.kind.trains:
                found[plan.strategy.name] = left_behind(before, dict(vars(plan.strategy)))
    return call


def main() -> None:
    out, strategies = sys.argv[1], sys.argv[2:]
    torch.set_num_threads(1)
    found: dict = {}
    easyfit.model.call_on_rank = recording(easyfit.model.call_on_rank, found)
    x, y = make_data()
    for strategy in strategies:
        model = easyfit.Model(NETS.get(strategy, make_net)(), "cross_entropy", "adam")
        model.fit(x, y, batch_size=32, epochs=1, verbose=0, devices=2, accelerator="cpu", strategy=strategy,
                  validation_split=0.25)
    torch.save(found, os.path.join(out, f"{int(os.environ.get('RANK', 0))}.pt"))


if __name__ == "__main__":
    main()
