"""The run options (where and how a call runs), each declared once: its name, default, check and doc.

`takes_run_options` gives a public call (fit, evaluate, predict, the *_on_batch calls, `easyfit.launch`) every
option as a keyword-only argument, in its signature and docstring; its body reads one checked `RunOptions`.
Adding an option is one row of `OPTIONS`: every call, `help()` and the call's plan then have it."""
from __future__ import annotations

import inspect
import textwrap
from dataclasses import dataclass
from typing import Any, Callable

from easyfit.distributed.launcher_choice import Ray
from easyfit.parts.precision import parse_precision
from easyfit.utils.checks import check_flag, check_non_negative_int, check_positive_int, closest_name


def _check_launcher(value, name: str) -> None:
    if not (isinstance(value, Ray) or (isinstance(value, str) and value.lower() in ("auto", "ray"))):
        raise ValueError(f'{name} must be "auto", "ray" or easyfit.launchers.Ray(...), got {value!r}')


def _check_precision(value, name: str) -> None:
    if value is not None:
        parse_precision(value)


@dataclass(frozen=True)
class RunOption:
    """One run option: `check(value, name)` raises on a bad value before any work; `placement` options say where the
    ranks run, so `easyfit.launch()` takes them too."""
    name: str
    default: Any
    doc: str
    check: Callable[[Any, str], None] | None = None
    placement: bool = False


OPTIONS: list[RunOption] = [
    RunOption("devices", "auto", 'a count (on a CPU: processes), -1 for all, a list of ids, "auto" or "auto_select"',
              placement=True),
    RunOption("accelerator", "auto", '"auto" (CUDA, then MPS, then the CPU), "cpu", "gpu" / "cuda", "mps" or "tpu"',
              placement=True),
    RunOption("strategy", "auto", '"auto", a name ("ddp", "fsdp", "deepspeed", "pipeline", ...) or a Strategy object',
              placement=True),
    RunOption("launcher", "auto", '"auto" (the script re-run, spawn / fork, or the launcher that started this '
              'process), "ray" or easyfit.launchers.Ray(...): the call as a Ray Train TorchTrainer (docs/ray.md)',
              _check_launcher),
    RunOption("num_nodes", 1, "machines taking part; `devices` is per machine", check_positive_int, placement=True),
    RunOption("precision", None, '"32", "64", "bf16-mixed" or "16-mixed"; None: as the previous call ("32" at first)',
              _check_precision),
    RunOption("compile", False, "True, a torch.compile mode or a dict of its options: compile the step"),
    RunOption("auto_select_gpus", False, "take the first `devices` GPUs that accept work, not the first ones",
              check_flag, placement=True),
    RunOption("process_group_backend", None, '"nccl", "gloo", ...; None: nccl on CUDA, gloo otherwise',
              placement=True),
    RunOption("num_workers", 0, "DataLoader workers for in-memory data and datasets", check_non_negative_int),
    RunOption("replace_sampler", True, "give a DataLoader's own sampler each process's share", check_flag),
    RunOption("collate_fn", None, "makes a batch of samples of a dataset easyfit batches itself, e.g. transformers' "
              "DataCollatorWithPadding(tokenizer); None: stacked, numbers and lists as tensors"),
]


def option_names(placement_only: bool = False) -> list[str]:
    return [option.name for option in OPTIONS if option.placement or not placement_only]


class RunOptions:
    """One call's run options, checked, read-only: `run.devices`, `run.compile`, ..."""

    __slots__ = ("_values",)

    def __init__(self, **values):
        unknown = sorted(set(values) - set(option_names()))
        if unknown:
            raise TypeError(f"unknown run option(s) {', '.join(unknown)}.{closest_name(unknown[0], option_names())}")
        for option in OPTIONS:
            values.setdefault(option.name, option.default)
            if option.check is not None:
                option.check(values[option.name], option.name)
        object.__setattr__(self, "_values", values)

    def __getattr__(self, name: str):
        try:
            return object.__getattribute__(self, "_values")[name]
        except KeyError:
            raise AttributeError(f"no run option {name!r}") from None

    def __setattr__(self, name: str, value) -> None:
        raise AttributeError("run options are read-only: build new ones with replace()")

    def __reduce__(self):
        return RunOptions, (), self._values

    def __setstate__(self, values: dict) -> None:
        object.__setattr__(self, "_values", values)

    def __eq__(self, other) -> bool:
        return isinstance(other, RunOptions) and self._values == other._values

    def __repr__(self) -> str:
        return f"RunOptions({', '.join(f'{name}={value!r}' for name, value in self._values.items())})"

    def keywords(self) -> dict:
        """Every option as keyword arguments of a public call."""
        return dict(self._values)

    @classmethod
    def given(cls, keywords: dict, call: str) -> RunOptions:
        """The run options of a call (`takes_run_options`, named by its qualified name, e.g. "Model.fit") from the
        keywords its own arguments left: any other is refused by name, with the closest one the call takes. The
        declared function is looked up by name, not through the instance: a wrapper a user or a tool puts around the
        method (without functools.wraps) leaves the declaration as it was."""
        declared = DECLARED[call]
        known = [name for name in inspect.signature(declared).parameters if name != "self"]
        refuse_unknown(keywords, known)
        return cls(**{**declared.run_option_defaults, **keywords})

    def placement(self) -> dict:
        """The placement options (where the ranks run), as keywords of the connector's `connect`."""
        return {name: self._values[name] for name in option_names(placement_only=True)}

    def replace(self, **changes) -> RunOptions:
        return RunOptions(**{**self._values, **changes})


def documented(options: list[RunOption], defaults: dict, placement_only: bool = False) -> str:
    """The run options' part of a call's docstring, with the call's defaults."""
    lines = []
    for option in options:
        text = f"{option.name}: {option.doc} (default {defaults[option.name]!r})."
        lines.append(textwrap.fill(text, 116, initial_indent=" " * 12, subsequent_indent=" " * 16))
    title = "Placement options (where the ranks run)" if placement_only else \
        "Run options (every call takes them; where it runs and how)"
    return f"\n        {title}:\n" + "\n".join(lines) + "\n"


def refuse_unknown(given, known) -> None:
    """Refuse keywords a call does not take, naming the closest valid one."""
    unknown = sorted(set(given) - set(known))
    if unknown:
        raise TypeError(f"unexpected argument(s) {', '.join(unknown)}.{closest_name(unknown[0], known)} "
                        f"Valid ones: {', '.join(sorted(known))}.")


#: the calls that take the run options, by qualified name ("Model.fit"): what `RunOptions.given` reads
DECLARED: dict[str, Callable] = {}


def takes_run_options(placement_only: bool = False, **defaults) -> Callable:
    """Declare that a call takes every run option (only the placement ones with `placement_only`) through its
    `**run_options`: its signature and docstring (what `help()` shows) list each with its default (`defaults`
    overrides some for this call); its body reads them with `RunOptions.given(run_options, "Class.call")`."""
    def decorate(function: Callable) -> Callable:
        own = inspect.signature(function)
        own_parameters = [p for p in own.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
        options = [option for option in OPTIONS if option.placement or not placement_only]
        function.run_option_defaults = {option.name: defaults.get(option.name, option.default) for option in options}
        parameters = [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default)
                      for name, default in function.run_option_defaults.items()]
        function.__signature__ = own.replace(parameters=own_parameters + parameters)
        function.__doc__ = ((function.__doc__ or "").rstrip() + "\n"
                            + documented(options, function.run_option_defaults, placement_only))
        DECLARED[function.__qualname__] = function
        return function
    return decorate

