"""Nets built sharded from the start (`strategy.module_construction()`), as a real program.

Usage: python construction.py OUT_DIR STRATEGY [--built-only]        (easyfit.launch starts the 2 ranks)
       torchrun --nproc_per_node 2 construction.py OUT_DIR STRATEGY [--built-only]
--built-only: only what the launcher can change (memory, difference, val_loss, predictions, scores, plain), not the
hand_back=False and DeepSpeed checks (errors, lockstep, bf16_difference, refit_loss), which depend on the strategy
alone.
Each rank writes OUT_DIR/<rank>.pt with:
  memory       (bytes this rank holds, full bytes) of a net of ~2M parameters right after construction
  difference   max weight difference between the net built sharded and the same net built whole (same seed, same
               strategy), each after the same fit with validation
  val_loss     the validation losses of both fits
  predictions  rank-local predictions of the trained net built sharded; rank 0 saved it to OUT_DIR/saved.pt after fit
               and ModelCheckpoint wrote OUT_DIR/epoch<N>.pt inside it
  scores       evaluate() after fit, on every rank
  plain        the net built sharded is a plain module after fit: no hooks or DeepSpeed attributes, copies, pickles
  errors       what save / evaluate (DeepSpeed: and another fit) say after a fit with hand_back=False
  lockstep     with hand_back=False, fits whose validation shares are uneven (5 samples: 2 batches and 1; 1
               sample: 1 batch and none): how many times anything was gathered, and the validation losses beside
               those of the same fits with hand_back=True
  bf16_difference  (DeepSpeed) the same parity under precision="bf16-mixed", the net built in fp32
  refit_loss   (DeepSpeed) the first loss of another fit of that net after it was handed back (fresh_loss: the
               first loss of the net built whole, from its initial weights)
"""
import copy
import os
import pickle
import sys

import torch
from torch import nn

import easyfit
from easyfit.callbacks import ModelCheckpoint
from easyfit.distributed.strategy_parts.sharding import local_bytes

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import make_data, make_net

EPOCHS = 3


def big_net() -> nn.Module:
    return nn.Sequential(nn.Linear(6, 1024), nn.Tanh(), nn.Linear(1024, 1024), nn.Tanh(), nn.Linear(1024, 1024),
                         nn.Tanh(), nn.Linear(1024, 3))


def construction_bytes(net: nn.Module) -> tuple[int, int]:
    """(bytes this rank holds, bytes of the full net)."""
    held = sum(0 if p.is_meta else local_bytes([p]) for p in net.parameters())
    full = sum(getattr(p, "ds_numel", p.numel()) * p.element_size() for p in net.parameters())
    return held, full


def fit(net, strategy, out=None, call=None, epochs=EPOCHS, **options) -> easyfit.Model:
    x, y = make_data()
    model = easyfit.Model(net, "cross_entropy", torch.optim.Adam(net.parameters(), lr=0.01))
    callbacks = [ModelCheckpoint(os.path.join(out, "epoch{epoch}.pt"))] if out else []
    options = {"validation_data": (x[:50], y[:50]), **options}
    model.fit(x, y, batch_size=16, epochs=epochs, shuffle=False, verbose=0, lr_scaling=None, strategy=strategy,
              callbacks=callbacks, **call, **options)
    return model


def error_of(call) -> str:
    try:
        call()
    except ValueError as error:
        return str(error)
    return "no error"


def main() -> None:
    out, name, built_only = sys.argv[1], sys.argv[2], "--built-only" in sys.argv[3:]
    external = "LOCAL_RANK" in os.environ and "TORCHELASTIC_RUN_ID" in os.environ
    call = {} if external else {"devices": 2, "accelerator": "cpu"}
    torch.set_num_threads(1)
    strategy = easyfit.launch(strategy=name, **call)
    found = {}
    torch.manual_seed(5)
    with strategy.module_construction():
        big = big_net()
    found["memory"] = construction_bytes(big)
    del big

    whole = fit(make_net(), strategy, call=call)   # make_net seeds the RNG itself
    with strategy.module_construction():
        net = make_net()
    model = fit(net, name, out=out, call=call)   # by name: a new strategy object of that kind trains it
    found["difference"] = max((net.state_dict()[key] - value).abs().max().item()
                              for key, value in whole.net.state_dict().items())
    found["val_loss"] = (whole.history.history["val_loss"], model.history.history["val_loss"])
    found["fresh_loss"] = whole.history.history["loss"][0]
    x, y = make_data()
    if model.is_global_zero:   # after fit the full weights are in this process: rank 0 may save alone
        model.save(os.path.join(out, "saved.pt"))
    found["predictions"] = model.predict(x, devices=1, strategy="single")
    found["scores"] = model.evaluate(x, y, batch_size=8, verbose=0, return_dict=True)
    found["plain"] = is_plain(net)
    if built_only:
        torch.save(found, os.path.join(out, f"{strategy.global_rank}.pt"))
        return

    kept = easyfit.launch(strategy=type(strategy)(**options_of(strategy), hand_back=False), **call)
    with kept.module_construction():
        sharded_net = make_net()
    unreturned = fit(sharded_net, kept, call=call, epochs=1)
    found["errors"] = {"save": error_of(lambda: unreturned.save(os.path.join(out, "never.pt"))),
                       "evaluate": error_of(lambda: unreturned.evaluate(x, y, verbose=0))}
    found["lockstep"] = lockstep(strategy, call)
    if hasattr(strategy, "stage"):   # DeepSpeed: the engine still holds the net; and bf16-mixed, built in fp32
        found["errors"]["refit"] = error_of(lambda: fit(sharded_net, kept, call=call, epochs=1))
        whole = fit(make_net(), strategy, call=call, precision="bf16-mixed")
        with strategy.module_construction():
            net = make_net()
        fit(net, strategy, call=call, precision="bf16-mixed")
        found["bf16_difference"] = max((net.state_dict()[key] - value).abs().max().item()
                                       for key, value in whole.net.state_dict().items())
        found["refit_loss"] = fit(net, strategy, call=call, epochs=1).history.history["loss"][0]   # plain again
    torch.save(found, os.path.join(out, f"{strategy.global_rank}.pt"))


def lockstep(strategy, call) -> dict:
    gathered = []
    kept = easyfit.launch(strategy=type(strategy)(**options_of(strategy), hand_back=False), **call)
    count_full_state_reads(kept, gathered)
    x, y = make_data()
    losses = {}
    for size in (5, 1):
        for name, trained_by in (("kept", kept), ("handed_back", type(strategy)(**options_of(strategy)))):
            model = fit(make_net(), trained_by, call=call, epochs=2, validation_data=(x[:size], y[:size]),
                        validation_batch_size=2)
            losses[name, size] = model.history.history["val_loss"]
    return {"gathers": len(gathered), "val_loss": losses}


def count_full_state_reads(strategy, reads: list) -> None:
    """Record each read of `strategy`'s full module state: FSDP's own, or DeepSpeed's through its FullState."""
    if not hasattr(strategy, "stage"):
        read = strategy._full_module_state
        strategy._full_module_state = lambda *net: reads.append(net) or read(*net)
        return
    from easyfit.distributed.strategy_parts.deepspeed_state import FullState
    read = FullState.module_state
    FullState.module_state = lambda state: (state.ranks is strategy and reads.append(state)) or read(state)


def is_plain(net: nn.Module) -> bool:
    hooks = [hook for module in net.modules() for name, value in vars(module).items() if "hooks" in name
             and isinstance(value, dict) for hook in value]
    attributes = [name for item in (*net.modules(), *net.parameters()) for name in vars(item) if "ds_" in name]
    pickle.loads(pickle.dumps(copy.deepcopy(net)))
    return not hooks and not attributes and all(type(m._parameters) is dict for m in net.modules())


def options_of(strategy) -> dict:
    """The options that make another strategy object of the same kind."""
    if hasattr(strategy, "stage"):
        return {"stage": strategy.stage, "offload_optimizer": strategy.offload_optimizer,
                "offload_parameters": strategy.offload_parameters}
    return {"cpu_offload": strategy.cpu_offload}


if __name__ == "__main__":
    main()
