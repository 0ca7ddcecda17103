"""The `compile` option: its value as torch.compile's settings, checked against the call before any work, and
torch.compile's arguments made from them (the inductor passes easyfit adds on a tested torch)."""
from __future__ import annotations

from typing import Any

import torch

from easyfit.compiled.functional_step import unfusable_reason
from easyfit.utils.torch_internals import internals_tested, mode_names, mode_options, untested_reason

KEYWORDS = ("backend", "mode", "options", "fullgraph", "dynamic")
#: modes whose compiled graphs replay as CUDA graphs: their outputs are overwritten by the next replay
CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")


def compile_settings(value: Any) -> dict | None:
    """fit's `compile` as torch.compile's keyword arguments; None: the step runs eagerly."""
    if value is None or value is False:
        return None
    if value is True:
        return {}
    if isinstance(value, str):
        check_mode(value)
        return {"mode": value}
    if isinstance(value, dict):
        unknown = sorted(set(value) - set(KEYWORDS))
        if unknown:
            raise ValueError(f"compile got unknown option(s) {', '.join(map(repr, unknown))}; torch.compile "
                             f"options are {', '.join(KEYWORDS)}")
        if value.get("mode") is not None:
            check_mode(value["mode"])
            if value.get("options") and value.get("backend", "inductor") != "inductor":
                raise ValueError(f"compile={value!r} gives both a mode and options, which torch.compile takes for "
                                 "its inductor backend only; drop one of them")
        return dict(value)
    raise TypeError(f"compile must be True, False, a torch.compile mode or a dict of torch.compile options, got "
                    f"{type(value).__name__}")


def replays_cuda_graphs(settings: dict) -> bool:
    """Whether the compiled graphs of these settings replay as CUDA graphs (each replay overwrites the last one's
    outputs)."""
    return settings.get("mode") in CUDA_GRAPH_MODES


def check_mode(mode: str) -> None:
    """Raises unless `mode` is one of the modes the running torch's inductor lists."""
    modes = mode_names()
    if mode not in modes:
        raise ValueError(f"compile={mode!r} is not a torch.compile mode of torch {torch.__version__}; pass True, "
                         f"one of {', '.join(map(repr, modes))}, or a dict of torch.compile options")


def compile_arguments(settings: dict, extra: dict) -> dict:
    """torch.compile's keyword arguments from fit's settings, with `extra` inductor options. With inductor a mode is
    given as the options it stands for (torch.compile takes a mode or options, not both), and random layers draw
    eager's numbers (`fallback_random`), so Dropout trains as it does eagerly; on a tested torch each mask is one
    eager call (easyfit.compiled.eager_random) and CPU matrix products go to oneDNN where it is faster here
    (easyfit.compiled.onednn_matmul). Other backends get the mode or the options as given."""
    arguments = {key: value for key, value in settings.items() if key not in ("mode", "options")}
    given = settings.get("options") or {}
    if settings.get("backend", "inductor") != "inductor":
        if settings.get("mode") is not None:
            arguments["mode"] = settings["mode"]
        if given:
            arguments["options"] = dict(given)
        return arguments
    options = {**mode_options(settings.get("mode")), "fallback_random": True}
    if internals_tested():
        from easyfit.compiled import onednn_matmul
        from easyfit.compiled.eager_random import EagerMasks
        options.update({"post_grad_custom_pre_pass": EagerMasks(), **extra})
        if onednn_matmul.available():
            options["post_grad_custom_post_pass"] = onednn_matmul.OneDnnMatmuls()
    return {**arguments, "options": {**options, **given}}


def check_compile(value: Any, strategy, options, model, precision: str = "32") -> dict | None:
    """`compile` as torch.compile's settings; raises before any work when it is malformed, the strategy cannot
    compile its step, fit's `options` accumulate gradients under CUDA graphs, or ask for several steps per program
    where a callback must see every step or `model`'s step cannot be one (`whole_step_refusal`: all but counted
    items, which depend on the data, are known here)."""
    settings = compile_settings(value)
    steps = options.steps_per_execution
    every_step = [type(callback).__name__ for callback in options.callbacks or () if callback.needs_every_step]
    if steps not in ("auto", 1) and every_step:
        raise ValueError(f"{', '.join(every_step)} must see every optimizer step, but steps_per_execution={steps} "
                         f"shows the batch hooks every {steps}-th step only; pass steps_per_execution=1 or \"auto\"")
    if steps not in ("auto", 1):
        reason = whole_step_refusal(model.net, model.optimizer, precision == "16-mixed", strategy)
        if reason is not None:
            raise steps_need_one_program(steps, reason)
    if not strategy.capabilities.supports_compile:
        raise ValueError(f"strategy {strategy.name!r} does not support compile={value!r}: its step runs through "
                         "code torch.compile cannot trace as one step. Use compile=False, or strategy='single' / "
                         "'ddp' (see docs/strategies.md, supports_compile).")
    if replays_cuda_graphs(settings) and options.gradient_accumulation_steps > 1:
        raise ValueError(f"compile={value!r} replays CUDA graphs, and each replay overwrites the gradients the "
                         "previous one left, which gradient accumulation keeps across batches; use compile=True "
                         "(or mode 'max-autotune-no-cudagraphs') with gradient_accumulation_steps")
    return settings


def whole_step_refusal(net, optimizer, scaled: bool, strategy) -> str | None:
    """Why a training step cannot be one compiled program here, the data aside (None: it can): first a reason that
    holds on any torch, then the fallback's."""
    reason = unfusable_reason(net, optimizer, scaled, strategy)
    return reason if reason is not None or internals_tested() else untested_reason()


def steps_need_one_program(steps: int, reason: str) -> ValueError:
    return ValueError(f"steps_per_execution={steps} needs the whole step as one program, but {reason}; pass "
                      "steps_per_execution=1 (or 'auto')")
