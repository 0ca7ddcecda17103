"""Checkpoint folders a backend writes and reads itself, checked as data before the backend reads them.

- FSDP's sharded folder (torch.distributed.checkpoint): torch reads its `.metadata` with `pickle.load`; the shards
  themselves are raw tensor bytes and `torch.load(weights_only=True)` entries. Checked: `.metadata` unpickles with only
  torch's own checkpoint records (`DCP_GLOBALS`), and easyfit's FSDP_META_FILE loads as data.
- DeepSpeed's folder: DeepSpeed's `engine.load_checkpoint` reads every file with `torch.load(weights_only=False)`.
  Checked: every file loads with `weights_only=True` and only DeepSpeed's plain records (`deepspeed_globals`).
A folder that holds anything else is refused with UntrustedCheckpointError before the backend opens it.
"""
from __future__ import annotations

import glob
import os
import pickle

import torch

from easyfit.saving.checkpoint import load_data, untrusted
from easyfit.utils.deepspeed_import import autotuner_tracker_hidden

#: the classes (and functions that only rebuild a value) torch's checkpoint metadata pickles
DCP_GLOBALS = {
    "torch.distributed.checkpoint.metadata": {"ChunkStorageMetadata", "_MEM_FORMAT_ENCODING", "TensorProperties",
                                              "TensorStorageMetadata", "BytesStorageMetadata", "StorageMeta",
                                              "Metadata", "MetadataIndex"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath"},
    "collections": {"OrderedDict"},
}
DCP_METADATA_FILE = ".metadata"


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles only the records in DCP_GLOBALS (and torch's dtypes), as Python's docs restrict globals."""

    def find_class(self, module: str, name: str):
        if name in DCP_GLOBALS.get(module, ()) or (module == "torch" and isinstance(getattr(torch, name, None),
                                                                                  torch.dtype)):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name}")


def check_dcp_folder(directory: str) -> None:
    """Raise unless the torch.distributed.checkpoint folder's metadata holds only torch's checkpoint records."""
    path = os.path.join(directory, DCP_METADATA_FILE)
    try:
        with open(path, "rb") as file:
            _MetadataUnpickler(file).load()
    except pickle.UnpicklingError as error:
        raise untrusted(path, f"it names {error}, which torch's checkpoint metadata never holds") from None


def deepspeed_globals() -> tuple:
    """The plain records DeepSpeed's checkpoint files pickle besides data: its loss scalers, the ZeRO stage and the
    place of a parameter's fragment."""
    with autotuner_tracker_hidden():
        from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
        from deepspeed.runtime.zero.config import ZeroStageEnum
        from deepspeed.utils.tensor_fragment import fragment_address
    return LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address


def load_deepspeed_file(path: str, trusted: bool = False, **options):
    """One file of a DeepSpeed checkpoint folder, as data and DeepSpeed's plain records."""
    return load_data(path, "cpu", trusted, deepspeed_globals(), **options)


def check_deepspeed_folder(folder: str) -> None:
    """Raise unless every file of a DeepSpeed checkpoint (one tag's folder) loads as data (memory-mapped: the
    tensors are not read)."""
    for path in sorted(glob.glob(os.path.join(folder, "*.pt"))):
        load_deepspeed_file(path, mmap=True)
