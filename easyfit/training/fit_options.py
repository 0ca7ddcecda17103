"""fit's own options (what to train on and how), each declared once: its name, default, check, doc and kind.

`takes_fit_options` writes them into a call's signature and docstring (fit, find_lr, find_batch_size: what `help()`
shows); `FitOptions` is one fit's values, checked by `check_each`; the rows marked `setting` are also the loop's
`TrainingSettings` (what the strategy and the compiled steps see), and those marked `in_step_key` key the compiled
programs. Adding an option is one row of `FIT_OPTIONS`."""
from __future__ import annotations

import inspect
import os
import textwrap
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


def _check_epochs(value, name: str) -> None:
    if not (type(value) is int and value == 0):   # 0 trains nothing: an empty History
        check_positive_int(value, name, "a non-negative integer")


def _or_none(check: Callable, expected: str) -> Callable[[Any, str], None]:
    """`check(value, name, expected)` for a value that may also be None."""
    def check_given(value, name: str) -> None:
        if value is not None:
            check(value, name, expected)
    return check_given


def _check_initial_epoch(value, name: str) -> None:
    check_non_negative_int(value, name, "a non-negative integer (the epoch to start at, counted from 0)")


def _check_fault_tolerance(value, name: str) -> None:
    if value not in (None, True, False) and not isinstance(value, (str, os.PathLike)):
        raise TypeError(f"{name} must be False (off), True / None (on under a launcher that restarts ranks) or the "
                        f"folder of its checkpoints, got {type(value).__name__}")


@dataclass(frozen=True)
class FitOption:
    """One fit option: `check(value, name)` raises on a bad value before any work; `convert` brings an accepted form
    to the one easyfit uses; `keyword_only` as in fit's signature; `setting`: a field of the loop's
    `TrainingSettings`; `in_step_key`: a compiled whole-step program depends on its value."""
    name: str
    default: Any
    doc: str
    check: Callable[[Any, str], None] | None = None
    convert: Callable[[Any], Any] | None = None
    keyword_only: bool = False
    setting: bool = False
    in_step_key: bool = False


FIT_OPTIONS: list[FitOption] = [
    FitOption("batch_size", 32, "samples per batch and process; the effective batch is this × the processes",
              check_positive_int, setting=True),
    FitOption("epochs", 1, "the index of the last epoch, as in Keras: resuming after epoch 4 with epochs=8 trains 5 "
              "to 8", _check_epochs),
    FitOption("verbose", "auto", '0 silent, 1 a progress bar, 2 a line per epoch; "auto": 1 on a terminal, else 2',
              lambda value, name: check_verbose(value)),
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
              "(docs/api.md; checked with compile=)", keyword_only=True, setting=True),
]


def fit_option_names() -> list[str]:
    return [option.name for option in FIT_OPTIONS]


class _Values:
    """Named values with defaults from rows (`_rows()`), refusing unknown names; attributes, compared by value."""

    @classmethod
    def _rows(cls) -> dict:
        raise NotImplementedError

    def __init__(self, **values):
        rows = self._rows()
        unknown = sorted(set(values) - set(rows))
        if unknown:
            raise TypeError(f"{type(self).__name__} has no {', '.join(unknown)}")
        for name, default in rows.items():
            object.__setattr__(self, name, values.get(name, default))

    def __eq__(self, other) -> bool:
        return type(other) is type(self) and vars(other) == vars(self)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(f'{name}={value!r}' for name, value in vars(self).items())})"


class FitOptions(_Values):
    """One fit's own options (`FIT_OPTIONS`), read-only: `options.epochs`, `options.batch_size`, ..."""

    @classmethod
    def _rows(cls) -> dict:
        return {option.name: option.default for option in FIT_OPTIONS}

    @classmethod
    def given(cls, positional: tuple, keywords: dict, call: str = "fit") -> tuple[FitOptions, dict]:
        """The fit options of a call from its extra positional arguments (the positional options, in order) and
        keywords; the keywords left (the run options, or misspelt names) come back apart."""
        names = [option.name for option in FIT_OPTIONS if not option.keyword_only]
        if len(positional) > len(names):
            raise TypeError(f"{call} takes at most {len(names) + 2} positional arguments (x, y, {', '.join(names)}), "
                            f"got {len(positional) + 2}")
        values, rest = dict(zip(names, positional)), dict(keywords)
        for name in fit_option_names():
            if name in rest:
                if name in values:
                    raise TypeError(f"{call} got multiple values for argument {name!r}")
                values[name] = rest.pop(name)
        return cls(**values), rest

    def __setattr__(self, name: str, value) -> None:
        raise AttributeError("fit options are read-only: build new ones with replace()")

    def replace(self, **changes) -> FitOptions:
        return FitOptions(**{**vars(self), **changes})

    def checked(self) -> FitOptions:
        """Check each option on its own (`FitOption.check`); the options in the forms easyfit uses (`convert`)."""
        values = {}
        for option in FIT_OPTIONS:
            value = values[option.name] = getattr(self, option.name)
            if option.check is not None:
                option.check(value, option.name)
            if option.convert is not None:
                values[option.name] = option.convert(value)
        return FitOptions(**values)


#: the loop's own settings, besides the fit options marked `setting`
LOOP_SETTINGS = {"scheduler_interval": "epoch", "precision": "32"}


class TrainingSettings(_Values):
    """How fit trains (the fit options marked `setting`, the scheduler's interval, the precision); the strategy sees
    them before `setup` (`Strategy.configure_training`); read-only."""

    def __setattr__(self, name: str, value) -> None:
        raise AttributeError("training settings are read-only: build new ones with TrainingSettings.of(...)")

    @classmethod
    def _rows(cls) -> dict:
        return {**{option.name: option.default for option in FIT_OPTIONS if option.setting}, **LOOP_SETTINGS}

    @classmethod
    def of(cls, options: FitOptions, **loop_settings) -> TrainingSettings:
        return cls(**{option.name: getattr(options, option.name) for option in FIT_OPTIONS if option.setting},
                   **loop_settings)

    def step_key(self) -> tuple:
        """The settings a compiled whole-step program depends on: part of its cache key."""
        return tuple((option.name, getattr(self, option.name, option.default)) for option in FIT_OPTIONS
                     if option.in_step_key)


def documented(options: list[FitOption], defaults: dict) -> str:
    """The fit options' part of a call's docstring, with the call's defaults."""
    lines = [textwrap.fill(f"{option.name}: {option.doc} (default {defaults[option.name]!r}).", 116,
                           initial_indent=" " * 12, subsequent_indent=" " * 16) for option in options]
    return "\n        Fit options:\n" + "\n".join(lines) + "\n"


def takes_fit_options(leave_out: tuple = (), keyword_only: bool = False, **defaults) -> Callable:
    """Declare that a call takes fit's options through its `*positional` / `**keywords`: its signature and docstring
    list each (but `leave_out`, and those the call names itself) with its default (`defaults` overrides some for
    this call), in fit's kinds, or every one keyword-only (`keyword_only`: the finders)."""
    def decorate(function: Callable) -> Callable:
        kept = [p for p in inspect.signature(function).parameters.values()
                if p.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)]
        options = [option for option in FIT_OPTIONS if option.name not in set(leave_out) | {p.name for p in kept}]
        positional = inspect.Parameter.POSITIONAL_OR_KEYWORD
        kinds = {option.name: inspect.Parameter.KEYWORD_ONLY if option.keyword_only or keyword_only else positional
                 for option in options}
        ordered = sorted(options, key=lambda option: kinds[option.name] is not positional)   # stable: rows' order
        values = {option.name: defaults.get(option.name, option.default) for option in options}
        parameters = kept + [inspect.Parameter(option.name, kinds[option.name], default=values[option.name])
                             for option in ordered]
        function.__signature__ = inspect.signature(function).replace(parameters=parameters)
        function.__doc__ = (function.__doc__ or "").rstrip() + "\n" + documented(options, values)
        return function
    return decorate
