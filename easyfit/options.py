"""The options of fit / evaluate / predict: which keyword goes where, and fit's checks before any work."""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from easyfit.lr_scaling import lr_multiplier
from easyfit.validation import check_fit_arguments, check_positive_int, check_positive_number, closest_name


@dataclass
class RunOptions:
    """Where and how a fit / evaluate / predict call runs (accepted by all three)."""
    devices: Any = "auto"
    accelerator: str = "auto"
    auto_select_gpus: bool = False
    strategy: Any = "auto"
    num_nodes: int = 1
    process_group_backend: str | None = None
    precision: Any = None   # None: as in the previous call ("32" at first)
    num_workers: int = 0
    replace_sampler: bool = True
    compile: Any = False   # True, a torch.compile mode or a dict of its options: see easyfit.compiling


@dataclass
class FitOptions:
    """What fit accepts besides the run options; docs/api.md describes each."""
    epochs: int = 1
    batch_size: int = 32
    validation_data: Any = None
    validation_split: float = 0.0
    validation_batch_size: int | None = None
    validation_freq: int = 1
    shuffle: bool = True
    seed: int = 0
    verbose: int | str = "auto"
    callbacks: list = field(default_factory=list)
    initial_epoch: int = 0
    resume_from: str | None = None
    gradient_accumulation_steps: int = 1
    gradient_clip_val: float | None = None
    lr_scaling: str | None = "linear"
    lr_warmup_epochs: int = 0
    sample_weight: Any = None
    class_weight: dict | None = None
    steps_per_epoch: int | None = None
    validation_steps: int | None = None


def split_options(kwargs: dict, *option_types) -> list:
    """Build each options dataclass from the keyword arguments it knows; reject the rest by name."""
    known = {f.name for option_type in option_types for f in fields(option_type)}
    unknown = sorted(set(kwargs) - known)
    if unknown:
        raise TypeError(f"unexpected argument(s) {', '.join(unknown)}.{closest_name(unknown[0], known)} "
                        f"Valid ones: {', '.join(sorted(known))}.")
    return [option_type(**{f.name: kwargs[f.name] for f in fields(option_type) if f.name in kwargs})
            for option_type in option_types]


def check_fit_options(options: FitOptions) -> None:
    """Raise, before any training work, on a fit option that is out of range, saying what is accepted."""
    check_positive_int(options.batch_size, "batch_size")
    if not (type(options.epochs) is int and options.epochs == 0):   # 0 trains nothing: an empty History
        check_positive_int(options.epochs, "epochs", "a non-negative integer")
    for name in ("steps_per_epoch", "validation_steps"):
        if getattr(options, name) is not None:
            check_positive_int(getattr(options, name), name, "a positive integer or None")
    check_positive_int(options.gradient_accumulation_steps, "gradient_accumulation_steps")
    if options.gradient_clip_val is not None:   # 0 would freeze training, a negative value reverse it
        check_positive_number(options.gradient_clip_val, "gradient_clip_val",
                              "a positive number (the largest total gradient norm), or None for no clipping")
    lr_multiplier(options.lr_scaling, 1)
    check_fit_arguments(options)
