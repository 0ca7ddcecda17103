"""The DeepSpeed config easyfit derives from fit's arguments and the net, with the user's keys laid over it.

DeepSpeed sizes its communication buckets at 5e8 elements (stage 3's prefetch bucket at 5e7) whatever the net: on a
net of tens of millions of parameters its buffers then hold several times the memory of the net itself. Unless the
user sets them, easyfit sizes them from the number of parameters trained (`bucket_elements`).
"""
from __future__ import annotations

import json
import os
from typing import Any

CONFIG_VARIABLE = "EASYFIT_DEEPSPEED_CONFIG"
#: DeepSpeed's own bucket size, in elements: the most easyfit chooses
LARGEST_BUCKET = 500_000_000
#: the fewest elements of a bucket, unless the net has fewer parameters
SMALLEST_BUCKET = 1_000_000
#: a bucket holds this share of the parameters trained
BUCKET_SHARE = 1 / 32
#: bucket sizes are multiples of this (DeepSpeed needs a multiple of its NCCL alignment)
BUCKET_ALIGNMENT = 1024
SIZED_KEYS = ("reduce_bucket_size", "allgather_bucket_size", "stage3_prefetch_bucket_size")


def bucket_elements(num_params: int) -> int:
    """Bucket size for a net of `num_params` trained parameters: 1/32 of them, at least 1e6 (or all of them, if
    fewer) and at most DeepSpeed's 5e8, in multiples of 1024. Collectives of a few MB already run at
    full bandwidth, and the buffers DeepSpeed keeps per bucket (several with overlapping communication) stay a small
    share of the net's memory."""
    size = -(-max(num_params * BUCKET_SHARE, min(num_params, SMALLEST_BUCKET)) // BUCKET_ALIGNMENT) * BUCKET_ALIGNMENT
    return int(min(size, LARGEST_BUCKET // BUCKET_ALIGNMENT * BUCKET_ALIGNMENT))


def merge(defaults: dict, user: dict) -> dict:
    """`defaults` with `user` laid over it, nested sections merged key by key: every key the user sets wins."""
    merged = dict(defaults)
    for key, value in user.items():
        merged[key] = merge(merged[key], value) if isinstance(value, dict) and isinstance(merged.get(key), dict) \
            else value
    return merged


def read_config(config: str | os.PathLike | dict | None) -> dict:
    """The user's DeepSpeed config: a dict, a JSON file, or the file EASYFIT_DEEPSPEED_CONFIG names; {} if none."""
    if config is None:
        config = os.environ.get(CONFIG_VARIABLE) or None
    if config is None or isinstance(config, dict):
        return dict(config or {})
    path = os.fspath(config)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"the DeepSpeed config {path!r} does not exist; pass a dict or the path of a JSON file")
    with open(path, encoding="utf-8") as file:
        try:
            return json.load(file)
        except json.JSONDecodeError as error:
            raise ValueError(f"the DeepSpeed config {path!r} is not valid JSON: {error}") from None


class DeepSpeedConfig:
    """Builds the config for a DeepSpeed strategy's settings: the ZeRO section, fit's batch / accumulation /
    clipping / precision, and bucket sizes fitted to the net, each overridden by any key of `user`."""

    def __init__(self, stage: int, offload_optimizer: bool, offload_parameters: bool, buckets: dict,
                 user: dict, pin_memory: bool):
        self.stage, self.offload_optimizer, self.offload_parameters = stage, offload_optimizer, offload_parameters
        self.buckets, self.user, self.pin_memory = buckets, user, pin_memory

    def zero_section(self, num_params: int | None = None) -> dict[str, Any]:
        zero: dict[str, Any] = {"stage": self.stage}
        if num_params is not None:
            size = bucket_elements(num_params)
            zero.update({key: size for key in SIZED_KEYS[:2 + (self.stage == 3)]})
        zero.update({key: int(value) for key, value in self.buckets.items() if value is not None})
        if self.offload_optimizer:
            zero["offload_optimizer"] = {"device": "cpu", "pin_memory": self.pin_memory}
        if self.offload_parameters:
            zero["offload_param"] = {"device": "cpu", "pin_memory": self.pin_memory}
        return zero

    def training(self, settings, num_params: int | None = None) -> dict:
        """The config `deepspeed.initialize` gets for a fit with these `settings` (a loop.TrainingSettings)."""
        derived = {
            "train_micro_batch_size_per_gpu": settings.batch_size,
            "gradient_accumulation_steps": settings.gradient_accumulation_steps,
            # DeepSpeed clips at 1.0 unless told otherwise: training must not change silently
            "gradient_clipping": float(settings.gradient_clip_val or 0.0),
            "zero_optimization": self.zero_section(num_params),
            "zero_allow_untested_optimizer": True,
            "zero_force_ds_cpu_optimizer": False,   # the user's torch optimizer, also with offload
            "steps_per_print": 2 ** 31,
        }
        if settings.precision == "bf16-mixed":
            derived["bf16"] = {"enabled": True}
        elif settings.precision == "16-mixed":
            derived["fp16"] = {"enabled": True}
        return merge(derived, self.user)

    def construction(self) -> dict:
        """The config `zero.Init` partitions with, before any fit: the ZeRO section and the user's keys. torch's
        linear is left as it is (DeepSpeed would replace it for the rest of the process)."""
        derived: dict[str, Any] = {"zero_optimization": {**self.zero_section(), "memory_efficient_linear": False}}
        if not {"train_batch_size", "train_micro_batch_size_per_gpu"} & set(self.user):
            derived["train_micro_batch_size_per_gpu"] = 1   # a placeholder: fit sets the real one
        return merge(derived, self.user)

    @staticmethod
    def describe(config: dict) -> str:
        """Words for the summary line: the bucket sizes DeepSpeed runs with."""
        zero = config.get("zero_optimization", {})
        sizes = ", ".join(f"{key.replace('stage3_', '').replace('_size', '')} {zero[key]:.3g}"
                          for key in SIZED_KEYS if key in zero)
        return f"DeepSpeed buckets (elements): {sizes}" if sizes else "DeepSpeed buckets: DeepSpeed's defaults"
