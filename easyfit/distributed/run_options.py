"""The run options (where and how a call runs), each declared once: its name, default, check and doc
(easyfit.utils.options).

Every public call (fit, evaluate, predict, the finders, the *_on_batch calls) writes each one in its signature as a
keyword-only parameter (a test holds them equal to these rows), and `easyfit.launch()` the placement ones; its
docstring gets their docs, and its body reads one checked `RunOptions`. Adding an option is one row of `OPTIONS`
and its parameter in those calls."""
from __future__ import annotations

from dataclasses import dataclass

from easyfit.distributed.launcher_choice import Ray
from easyfit.parts.precision import parse_precision
from easyfit.utils.checks import check_flag, check_non_negative_int, check_positive_int
from easyfit.utils.options import Option, Values


def _check_launcher(value, name: str) -> None:
    if not (isinstance(value, Ray) or (isinstance(value, str) and value.lower() in ("auto", "ray"))):
        raise ValueError(f'{name} must be "auto", "ray" or easyfit.launchers.Ray(...), got {value!r}')


def _check_precision(value, name: str) -> None:
    if value is not None:
        parse_precision(value)


@dataclass(frozen=True)
class RunOption(Option):
    """One run option (`Option`), keyword-only in every call; `placement` options say where the ranks run, so
    `easyfit.launch()` takes them too."""
    keyword_only: bool = True
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


class RunOptions(Values):
    """One call's run options, checked as they are made, read-only: `run.devices`, `run.compile`, ..."""

    title, note = "run options", " (every call takes them; where it runs and how)"
    rows = OPTIONS

    def __init__(self, *positional, **values):
        super().__init__(*positional, **values)
        self.check()   # as they are made: before any work

    def placement(self) -> dict:
        """The placement options (where the ranks run), as keywords of the connector's `connect`."""
        return {name: getattr(self, name) for name in option_names(placement_only=True)}


class Placement(RunOptions):
    """The placement options alone (`easyfit.launch()`'s)."""

    title, note = "placement options", " (where the ranks run)"
    rows = [option for option in OPTIONS if option.placement]
