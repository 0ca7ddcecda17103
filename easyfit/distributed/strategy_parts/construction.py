"""Nets built sharded from the start (`Strategy.module_construction()`): which kind a net is, the checks that keep
such a net from being used as if it held its weights, and the ranks a construction that partitions needs."""
from __future__ import annotations

from itertools import chain

import torch

#: a net built under FSDP2's context: its parameters are on the meta device (no data yet)
META = "meta"
#: a net built under DeepSpeed's ZeRO-3 context: each rank holds a partition of every parameter
ZERO3 = "zero3"
HOLDS = {META: "its parameters are on the meta device", ZERO3: "each rank holds a DeepSpeed ZeRO-3 partition of it"}
BUILT_BY = {META: "strategy 'fsdp' / 'fsdp_cpu_offload'", ZERO3: "a DeepSpeed stage 3 strategy"}


def built_sharded(net: torch.nn.Module) -> str | None:
    """META or ZERO3 for a net that holds no full weights of its own yet; None for an ordinary net."""
    if any(hasattr(p, "ds_id") for p in net.parameters()):
        return ZERO3
    if any(t.is_meta for t in chain(net.parameters(), net.buffers())):
        return META
    return None


def no_weights(kind: str, action: str) -> ValueError:
    return ValueError(
        f"cannot {action}: the net holds no full weights ({HOLDS[kind]}). It was built under "
        "strategy.module_construction(), and no fit with hand_back=True (the default) has put the trained weights "
        "into it. Fit it with hand_back=True, or save inside that fit (a ModelCheckpoint; state_dict_type='sharded' "
        "for a net too big to gather) and load the file into a plain net: Model.load(path, net=Net()).")


def check_built_sharded(net: torch.nn.Module, training: bool, trains: str | None) -> None:
    """Before a call (`training`: a fit): a net built sharded is trained only by a strategy that trains its kind
    (`trains`, the strategy's `trains_built_sharded`), and evaluated or predicted only once it holds its weights."""
    kind = built_sharded(net)
    if kind == ZERO3 and training:
        from easyfit.distributed.strategy_parts.zero_init import held_by_engine
        if held_by_engine(net):
            raise ValueError("this net is still the module of the DeepSpeed engine of an earlier fit with "
                             "hand_back=False, which keeps it partitioned; it cannot be trained again. Build it "
                             "again, or fit with hand_back=True (the default), which makes it a plain module.")
    if kind is None or (training and kind == trains):
        return
    if training:
        raise ValueError(f"this net was built under module_construction() of {BUILT_BY[kind]} ({HOLDS[kind]}); "
                         "fit it with that strategy (pass the same strategy object to fit)")
    raise no_weights(kind, "evaluate or predict with it")


def prepare_for_state(net: torch.nn.Module, loading: bool) -> None:
    """Before the state of a net outside fit is read or loaded: a meta net is materialized to take a loaded state;
    reading it, or anything with ZeRO-3 partitions, is refused."""
    kind = built_sharded(net)
    if kind is None:
        return
    if kind == META and loading:
        from easyfit.distributed.strategy_parts.meta_init import materialize
        return materialize(net)
    raise no_weights(kind, "load a state into it outside fit" if loading else "read its state (save, net_state)")


def join_ranks(strategy) -> None:
    """Make sure `strategy` knows its ranks and their process group exists, for a construction that partitions
    parameters over the ranks. Under torchrun / SLURM / the deepspeed launcher an unconfigured strategy reads the
    ranks from the launcher; in a plain script `easyfit.launch(strategy=...)` must have started them."""
    from easyfit.distributed.environments import detect_environment
    if getattr(strategy, "environment", None) is None:
        if not detect_environment().creates_processes_externally:
            raise ValueError(
                f"strategy {strategy.name!r} does not know its ranks yet, and module_construction() partitions the "
                "net over them: start them first with strategy = easyfit.launch(strategy=..., devices=N) at the top "
                "of the script (then use that strategy), or run the script under torchrun / SLURM / deepspeed")
        from easyfit.distributed.calls import configure_for_call, read_call
        configure_for_call(strategy, read_call())
    from easyfit.distributed.strategies.states import Launched
    launcher = strategy.make_launcher()
    if launcher is None:
        strategy.setup_environment()
    else:   # the launcher's handshake: a rank that failed before getting here is reported, not waited for
        launcher.start(strategy.setup_environment, Launched(True, not launcher.rank_zero_in_caller))
