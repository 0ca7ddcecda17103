"""Turn a sharded checkpoint directory into one plain easyfit checkpoint file, on one process, without the ranks
that wrote it: `Model.load(file, net=PlainNet())` then reads it, and `fit(resume_from=file)` continues from it under
any strategy. Also rewrites a checkpoint file that holds more than data (one written by an older easyfit) as data,
for a file you trust (`trusted=True`, `--trusted`).

Two formats are read:
- FSDP2's (strategy "fsdp" with state_dict_type="sharded"): a torch.distributed.checkpoint directory, read with
  torch's `dcp_to_torch_save`;
- DeepSpeed's (state_dict_type="sharded"): the weights merged from every rank's partitions with DeepSpeed's
  zero_to_fp32 utilities, and the optimizer state (e.g. Adam's moments) merged the same way.
Every file is read as data (saving/backend_folders.py), unless `trusted`.

Usage: python -m easyfit.checkpoint_convert SOURCE DESTINATION_FILE [--trusted]
"""
from __future__ import annotations

import argparse
import os
import tempfile

import torch

from easyfit.saving.backend_folders import check_dcp_folder, load_deepspeed_file
from easyfit.saving.checkpoint import (
    DEEPSPEED_CLIENT_KEY,
    FORMAT_KEY,
    FSDP_META_FILE,
    load_checkpoint_file,
    load_data,
    save_checkpoint_file,
)
from easyfit.utils.deepspeed_import import autotuner_tracker_hidden


def convert_checkpoint(source: str | os.PathLike, destination: str | os.PathLike, trusted: bool = False) -> None:
    """Write the sharded checkpoint directory `source`, or the checkpoint file `source`, as one plain checkpoint file
    `destination` that holds data only. `trusted=True` unpickles any object in `source`: only for a source you
    trust."""
    source = os.fspath(source)
    if os.path.isfile(source):
        state = load_checkpoint_file(source, map_location="cpu", trusted=trusted)
    elif os.path.isfile(os.path.join(source, FSDP_META_FILE)):
        state = read_fsdp(source, trusted)
    elif os.path.isfile(os.path.join(source, "latest")):
        state = read_deepspeed(source, trusted)
    else:
        raise ValueError(f"{source!r} is not a sharded easyfit checkpoint: expected a directory written with "
                         f"state_dict_type='sharded' by strategy 'fsdp' (it holds {FSDP_META_FILE}) or a DeepSpeed "
                         "strategy (it holds a 'latest' file), or a checkpoint file")
    state.pop(FORMAT_KEY, None)
    save_checkpoint_file(destination, state)


def indexed_optimizer_state(state: dict, groups: list[dict], names: list[str]) -> dict:
    """A name-keyed optimizer state ({name: {...}}) in the plain optimizer's form, keyed by the position of each
    parameter in the optimizer (`names`, in that order); `groups` carry the hyper-parameters."""
    index = {name: position for position, name in enumerate(names)}
    plain_groups = [{**{k: v for k, v in group.items() if k != "params"},
                     "params": [index[name] if isinstance(name, str) else name for name in group["params"]]}
                    for group in groups]
    return {"state": {index[name]: entry for name, entry in state.items()}, "param_groups": plain_groups}


def read_fsdp(directory: str, trusted: bool = False) -> dict:
    """The full state of an FSDP2 torch.distributed.checkpoint directory."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    rest = load_checkpoint_file(os.path.join(directory, FSDP_META_FILE), map_location="cpu", trusted=trusted)
    if not trusted:
        check_dcp_folder(directory)
    with tempfile.TemporaryDirectory() as scratch:
        whole = os.path.join(scratch, "whole.pt")
        dcp_to_torch_save(directory, whole)
        shards = load_data(whole, map_location="cpu", trusted=trusted)
    names = rest.pop("param_names")
    optimizer = shards["optimizer"]
    return {**rest, "net": shards["net"],
            "optimizer": indexed_optimizer_state(optimizer["state"], optimizer["param_groups"], names)}


def read_deepspeed(directory: str, trusted: bool = False) -> dict:
    """The full state of a DeepSpeed ZeRO checkpoint directory (any stage): fp32 weights and optimizer state."""
    with autotuner_tracker_hidden():
        from deepspeed.utils import zero_to_fp32
    with open(os.path.join(directory, "latest"), encoding="utf-8") as file:
        folder = os.path.join(directory, file.read().strip())
    model_files = zero_to_fp32.get_model_state_files(folder)
    rest = load_deepspeed_file(model_files[0], trusted)[DEEPSPEED_CLIENT_KEY]
    names, groups = rest.pop("param_names"), rest.pop("param_groups")
    partitions = [load_deepspeed_file(path, trusted)["optimizer_state_dict"]
                  for path in zero_to_fp32.get_optim_files(folder)]
    if not trusted:   # DeepSpeed's parse_model_states reads them again, unpickling
        for path in model_files:
            load_deepspeed_file(path, mmap=True)
    merge = _partition_merger(zero_to_fp32, zero_to_fp32.parse_model_states(model_files), partitions)
    stage = partitions[0]["zero_stage"]
    weights = merge([p["single_partition_of_fp32_groups" if stage <= 2 else "fp32_flat_groups"] for p in partitions])
    optimizer_states = [p["base_optimizer_state" if stage <= 2 else "optimizer_state_dict"]["state"]
                        for p in partitions]
    first = optimizer_states[0].get(0, {})
    state = {name: {} for name in names}
    for key, value in first.items():
        if isinstance(value, torch.Tensor) and value.dim() > 0:   # a flat partition: merged like the weights
            merged = merge([[rank[group][key] for group in sorted(rank)] for rank in optimizer_states])
            for name in names:
                state[name][key] = merged[name]
        else:   # e.g. Adam's step count, the same for every parameter
            for name in names:
                state[name][key] = value.clone() if isinstance(value, torch.Tensor) else value
    net = dict(weights)
    return {**rest, "net": net, "optimizer": indexed_optimizer_state(state if first else {}, groups, names)}


def _partition_merger(zero_to_fp32, model_states, partitions):
    """flat partitions per rank and group -> {parameter name: full tensor}, as DeepSpeed merges fp32 weights."""
    world_size, stage = len(partitions), partitions[0]["zero_stage"]

    def merge(flat_groups: list[list[torch.Tensor]]) -> dict:
        if stage <= 2:
            merged = zero_to_fp32._get_fp32_state_dict_from_zero2_checkpoint(
                world_size, flat_groups, model_states, False, partitions[0].get("param_alignment_paddings"))
        else:
            merged = zero_to_fp32._get_fp32_state_dict_from_zero3_checkpoint(world_size, flat_groups, model_states,
                                                                             False)
        return zero_to_fp32.to_torch_tensor(merged)
    return merge


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m easyfit.checkpoint_convert", description=__doc__.split("\n")[0])
    parser.add_argument("source", help="the sharded checkpoint directory, or a checkpoint file to rewrite as data")
    parser.add_argument("destination", help="the checkpoint file to write")
    parser.add_argument("--trusted", action="store_true",
                        help="unpickle any object the source holds (an older easyfit's file): only for a source you "
                             "trust, since unpickling can run code")
    args = parser.parse_args(argv)
    convert_checkpoint(args.source, args.destination, trusted=args.trusted)
    print(f"wrote {args.destination}")


if __name__ == "__main__":
    main()
