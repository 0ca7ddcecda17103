"""The one door to torch's internals: everything `compile=` reads or patches inside Dynamo, AOTAutograd and inductor.

Dynamo's code cache entries and their guard managers, the names it gives a graph's inputs and the globals its guards
read, its config and counters, inductor's mode options, its custom graph passes and its compiler wrapper, fake
tensors. None of these is a public API, so each torch release may change them: easyfit's use of them was written and
tested against the releases in `TESTED_TORCH`. On any other torch, `internals_tested()` is False and `compile=`
steps back to plain `torch.compile` of the step's parts (the forward with the loss, the optimizer step), without
easyfit's whole-step program, graph passes or patches, after a one-time notice: eager's numbers, never a wrong one.
`EASYFIT_PLAIN_COMPILE=1` asks for that path on a tested release too (a way round a failure of the fast path, and
how the tests run the fallback on every torch they have).

Modules that need inductor's classes import them from here (`CustomGraphPass`, `get_hash_for_files`,
`unset_fake_temporarily`): they load with torch's compiler, only when something compiles.
"""
from __future__ import annotations

import importlib
import os
import re
import warnings
from typing import Callable

import torch

#: the torch releases (major.minor) easyfit's use of torch's internals was written and tested against
TESTED_TORCH = ("2.14", "2.15")

#: the environment variable that, set to 1, runs compile= as plain torch.compile on any torch
PLAIN_COMPILE = "EASYFIT_PLAIN_COMPILE"

#: globals of torch's own modules and Python's builtins, as Dynamo's guards name them
FIXED_GLOBALS = ("G['__import_torch", "G['__builtins_dict", "__import__('torch')")
#: the root of a global a guard reads (`G['name']`)
GLOBAL_ROOT = re.compile(r"G\['[^']*'\]")
#: the name Dynamo gives a graph input from a function's argument: `l_params_0_` is `params[0]`,
#: `l_state_0_1_2_` is `state[0][1][2]`
GRAPH_INPUT = re.compile(r"l_(params|buffers|grads|state|inputs|targets|weights|rates)((?:_\d+)*)_")

#: the names this module hands out from torch's compiler modules, loaded on first use: (module, attribute)
LAZY = {"CustomGraphPass": ("torch._inductor.custom_graph_pass", "CustomGraphPass"),
        "get_hash_for_files": ("torch._inductor.custom_graph_pass", "get_hash_for_files"),
        "unset_fake_temporarily": ("torch._subclasses.fake_tensor", "unset_fake_temporarily")}

_noticed: set = set()


def __getattr__(name: str):
    if name not in LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module, attribute = LAZY[name]
    return getattr(importlib.import_module(module), attribute)


def torch_release() -> str:
    """The running torch's release, major.minor (a local build's suffix left out)."""
    return ".".join(torch.__version__.split("+")[0].split(".")[:2])


def plain_compile_asked() -> bool:
    return os.environ.get(PLAIN_COMPILE, "0") not in ("", "0")


def internals_tested() -> bool:
    """Whether the running torch is one that easyfit's use of its internals was tested on (and no one asked for
    plain torch.compile)."""
    return torch_release() in TESTED_TORCH and not plain_compile_asked()


def untested_reason() -> str:
    if plain_compile_asked():
        return f"{PLAIN_COMPILE}=1 asks for plain torch.compile"
    return (f"torch {torch_release()} is not one of the releases easyfit's compiled step was tested on "
            f"({', '.join(TESTED_TORCH)})")


def notice_untested() -> None:
    """Says once per process (and reason) that compile= runs as plain torch.compile."""
    if untested_reason() in _noticed:
        return
    _noticed.add(untested_reason())
    warnings.warn(f"compile=: {untested_reason()}, so the forward with the loss and the optimizer step are compiled "
                  "by plain torch.compile, without easyfit's whole-step program and graph passes (eager's numbers; "
                  "the speed may differ)", stacklevel=3)


# --- Dynamo ----------------------------------------------------------------------------------------------------
def dynamo_config():
    """torch._dynamo.config (loads in seconds: only when compiling)."""
    from torch._dynamo import config
    return config


def logging_left_out(methods: set):
    """Dynamo's setting under which calls of `methods` are left out of a traced graph instead of splitting it; a
    null context on an untested torch."""
    if not internals_tested():
        import contextlib
        return contextlib.nullcontext()
    config = dynamo_config()
    return config.patch(ignore_logging_functions=set(config.ignore_logging_functions) | methods)


def ddp_optimizer():
    """Dynamo's setting that splits a DDP-wrapped net's graph at its gradient buckets."""
    return dynamo_config().patch(optimize_ddp="ddp_optimizer")


def compile_totals() -> tuple[int, float]:
    """(graphs compiled, seconds spent compiling) in this process so far, as torch.compile counts them."""
    from torch._dynamo.utils import compilation_time_metrics, counters
    return counters["stats"]["unique_graphs"], sum(compilation_time_metrics.get("_compile.compile_inner", ()))


def mark_dynamic(tensor: torch.Tensor, dim: int) -> None:
    """Dynamo compiles `tensor`'s dimension `dim` for every size."""
    import torch._dynamo
    torch._dynamo.mark_dynamic(tensor, dim)


def is_dynamo_error(error: BaseException) -> bool:
    """Whether `error` was raised by Dynamo (while tracing or compiling), not by the traced code."""
    from torch._dynamo.exc import TorchDynamoException
    return isinstance(error, TorchDynamoException)


def newest_guards(code) -> object | None:
    """The guard manager of the newest graph Dynamo compiled for `code` (its `check(frame)` runs the graph's
    guards), or None."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list
    entries = _debug_get_cache_entry_list(code)
    return entries[0].guard_manager if entries else None


# --- inductor --------------------------------------------------------------------------------------------------
def mode_names() -> tuple[str, ...]:
    """The torch.compile modes the running torch's inductor lists."""
    from torch._inductor import list_mode_options
    return tuple(list_mode_options())


def mode_options(mode: str | None) -> dict:
    """The inductor options a torch.compile mode stands for."""
    from torch._inductor import list_mode_options
    return list_mode_options(mode or "default")


def compiler_for(backend: str, mode: str | None, options: dict) -> Callable:
    """The compiler torch.compile builds from these arguments, as a callable of (graph module, example inputs)."""
    if backend == "inductor":
        return torch._TorchCompileInductorWrapper(None, options, False)
    return torch._TorchCompileWrapper(backend, mode, options or None, False)
