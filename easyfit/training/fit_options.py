"""fit's own options (what to train on and how) and evaluate's and predict's, each declared once: its name, default,
check, doc and kind (easyfit.utils.options).

fit, find_lr and find_batch_size write `FIT_OPTIONS` in their signatures (a test holds them equal), evaluate and
predict `LOOP_OPTIONS`; `FitOptions` is one fit's values, checked in the plan; the rows marked `setting` are also the
loop's `TrainingSettings` (what the strategy and the compiled steps see), and those marked `in_step_key` key the
compiled programs. Adding an option is one row of `FIT_OPTIONS` and its parameter in those calls."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable

from easyfit.callbacks.base import callback_list
from easyfit.parts.lr_scaling import lr_multiplier
from easyfit.utils.checks import (
    check_flag,
    check_non_negative_int,
    check_positive_int,
    check_positive_number,
    check_verbose,
    validation_tuple,
)
from easyfit.utils.options import Option, Values


def _check_epochs(value, name: str) -> None:
    if not (type(value) is int and value == 0):   # 0 trains nothing: an empty History
        check_positive_int(value, name, "a non-negative integer")


def _or_none(check: Callable, expected: str) -> Callable[[Any, str], None]:
    """`check(value, name, expected)` for a value that may also be None."""
    def check_given(value, name: str) -> None:
        if value is not None:
            check(value, name, expected)
    return check_given


def _check_verbose(value, name: str) -> None:
    check_verbose(value)


def _check_initial_epoch(value, name: str) -> None:
    check_non_negative_int(value, name, "a non-negative integer (the epoch to start at, counted from 0)")


def _check_steps_per_execution(value, name: str) -> None:
    if value != "auto":
        check_positive_int(value, name, 'a positive integer or "auto"')


def _check_fault_tolerance(value, name: str) -> None:
    if value not in (None, True, False) and not isinstance(value, (str, os.PathLike)):
        raise TypeError(f"{name} must be False (off), True / None (on under a launcher that restarts ranks) or the "
                        f"folder of its checkpoints, got {type(value).__name__}")


@dataclass(frozen=True)
class FitOption(Option):
    """One fit option (`Option`); `setting`: a field of the loop's `TrainingSettings`; `in_step_key`: a compiled
    whole-step program depends on its value."""
    setting: bool = False
    in_step_key: bool = False


FIT_OPTIONS: list[FitOption] = [
    FitOption("batch_size", 32, "samples per batch and process; the effective batch is this × the processes × "
              "gradient_accumulation_steps", check_positive_int, setting=True),
    FitOption("epochs", 1, "the index of the last epoch, as in Keras: resuming after epoch 4 with epochs=8 trains 5 "
              "to 8", _check_epochs),
    FitOption("verbose", "auto", '0 silent, 1 a progress bar, 2 a line per epoch; "auto": 1 on a terminal, else 2',
              _check_verbose),
    FitOption("callbacks", None, "Callback objects (EarlyStopping, ModelCheckpoint, ...), or one alone",
              convert=callback_list),
    FitOption("validation_split", 0.0, "the share of the samples (the last ones) held out for validation"),
    FitOption("validation_data", None, "`(x_val, y_val)`, `(x_val, y_val, weights)`, a Dataset or a DataLoader",
              convert=validation_tuple),
    FitOption("shuffle", True, "reshuffle the training samples every epoch, as a function of (seed, epoch)",
              check_flag),
    FitOption("class_weight", None, "{class index: weight} weighing each sample's loss by its class"),
    FitOption("sample_weight", None, "one weight per training sample, for array / tensor `x`"),
    FitOption("initial_epoch", 0, "the epoch to start at, e.g. to continue a previous fit", _check_initial_epoch),
    FitOption("steps_per_epoch", None, "batches per epoch; None: all of them",
              _or_none(check_positive_int, "a positive integer or None")),
    FitOption("validation_steps", None, "validation batches per evaluation; None: all of them",
              _or_none(check_positive_int, "a positive integer or None")),
    FitOption("validation_batch_size", None, "the validation batch size; None: batch_size"),
    FitOption("validation_freq", 1, "validate every this many epochs", check_positive_int),
    FitOption("seed", 0, "the seed of the shuffle order", keyword_only=True),
    FitOption("resume_from", None, "a checkpoint (ModelCheckpoint, BackupAndRestore, save()) to continue exactly",
              keyword_only=True),
    FitOption("gradient_accumulation_steps", 1, "batches whose gradients make one optimizer step",
              check_positive_int, keyword_only=True, setting=True),
    FitOption("gradient_clip_val", None, "clip the total gradient norm to this value; None: no clipping",
              # 0 would freeze training, a negative value reverse it
              _or_none(check_positive_number, "a positive number (the largest total gradient norm), or None for no "
                                              "clipping"), keyword_only=True, setting=True, in_step_key=True),
    FitOption("lr_scaling", "linear", 'scale the LR by the batches per step: "linear", "sqrt" or None',
              lambda value, name: lr_multiplier(value, 1), keyword_only=True),
    FitOption("lr_warmup_epochs", 0, "ramp the LR from the unscaled to the scaled value over this many epochs",
              keyword_only=True),
    FitOption("max_restarts", None, "restart the ranks of a failed attempt this often; None: easyfit.launch's, "
              "or 0", _or_none(check_non_negative_int, "a non-negative integer (how often easyfit's launcher "
                                                       "restarts the ranks after a failure)"), keyword_only=True),
    FitOption("fault_tolerance", None, "None: checkpoint under a launcher that restarts ranks; False: off; or the "
              "folder of its checkpoints", _check_fault_tolerance, keyword_only=True),
    FitOption("fault_tolerance_every_n_steps", None, "also checkpoint every this many optimizer steps; None: at "
              "each epoch end only", _or_none(check_positive_int, "a positive number of optimizer steps, or None "
                                                                  "(a checkpoint at each epoch end only)"),
              keyword_only=True),
    FitOption("steps_per_execution", "auto", 'with compile=, training steps per compiled call; "auto" picks '
              "(docs/api.md)", _check_steps_per_execution, keyword_only=True, setting=True),
]


#: evaluate's and predict's options (predict's `verbose` is 0)
LOOP_OPTIONS: list[Option] = [
    Option("batch_size", 32, "samples per batch and process", check_positive_int),
    Option("verbose", 1, "0 silent, 1 a progress bar, 2 one line", _check_verbose),
    Option("callbacks", None, "Callback objects whose hooks for this call run", convert=callback_list),
]


def fit_option_names() -> list[str]:
    return [option.name for option in FIT_OPTIONS]


class FitOptions(Values):
    """One fit's own options (`FIT_OPTIONS`), read-only: `options.epochs`, `options.batch_size`, ..."""

    title, rows = "fit options", FIT_OPTIONS


class LoopOptions(Values):
    """The options of an evaluate or predict call (`LOOP_OPTIONS`): samples per batch and process, the display,
    the callbacks."""

    title, rows = "loop options", LOOP_OPTIONS


#: the loop's own settings, besides the fit options marked `setting`
LOOP_SETTINGS = [Option("scheduler_interval", "epoch", "when the scheduler steps"),
                 Option("precision", "32", "the precision's name")]


class TrainingSettings(Values):
    """How fit trains (the fit options marked `setting`, the scheduler's interval, the precision); the strategy sees
    them in `setup` (`Strategy.setup(..., settings)`); read-only."""

    title, rows = "training settings", [option for option in FIT_OPTIONS if option.setting] + LOOP_SETTINGS

    @classmethod
    def of(cls, options: FitOptions, **loop_settings) -> TrainingSettings:
        return cls(**{option.name: getattr(options, option.name) for option in FIT_OPTIONS if option.setting},
                   **loop_settings)

    def step_key(self) -> tuple:
        """The settings a compiled whole-step program depends on: part of its cache key."""
        return tuple((option.name, getattr(self, option.name, option.default)) for option in FIT_OPTIONS
                     if option.in_step_key)
