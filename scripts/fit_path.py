"""The path of `Model.fit(x, y, strategy="ddp", devices=2)` on rank 0, from model.py to the first optimizer step.

The path is the chain of easyfit calls on the stack at the first `optimizer.step()` (the spine), with, before each
spine call, the calls its caller made into other easyfit modules (the steps it took on the way; helpers of
`easyfit/utils/` left out). Printed as a numbered list (docs/architecture.md keeps it), then the counts: the main
modules passed, the calls into a module the path had already left (a doubling back), and the entries into such a
module by a call or a return alike. Last, the modules the call's plan enters (`plan_call` and every easyfit call
under it, the helpers of `easyfit/utils/` and property reads left out): the checks made before any process starts.
Then the whole trace, nothing left out but `easyfit/utils/` (a call through a helper of utils/ counts as a call from
its caller): every call from one easyfit module into another on the way to the first optimizer step, the plan's and
property reads included; the modules entered, the calls between modules and the re-entries (calls into a module the
trace entered before), and the modules by the calls into them.

    python scripts/fit_path.py            # the list and the counts
    python scripts/fit_path.py --counts   # the counts alone
    python scripts/fit_path.py --single   # a fit in one process (the numbered list is a ddp fit's)
"""
from __future__ import annotations

import collections
import os
import sys

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

import easyfit

ROOT = os.path.dirname(easyfit.__file__)
#: helpers every layer calls, not steps of the way
LEAVES = ("utils/checks.py", "utils/tensors.py", "utils/options.py")


class Call:
    def __init__(self, module: str, code, parent: Call | None):
        self.module, self.code, self.function, self.parent, self.calls = module, code, code.co_name, parent, []


class Recorder:
    """Records easyfit's calls as a tree, until the first optimizer step."""

    def __init__(self):
        self.root = Call("user code", main.__code__, None)
        self.current, self.frames, self.step = self.root, [None], None

    def profile(self, frame, event, arg) -> None:
        path = frame.f_code.co_filename
        if self.step is not None or not path.startswith(ROOT):
            return
        if event == "call":
            call = Call(os.path.relpath(path, ROOT), frame.f_code, self.current)
            self.current.calls.append(call)
            self.current = call
            self.frames.append(frame)
        elif event == "return" and self.frames[-1] is frame:
            self.current = self.current.parent
            self.frames.pop()

    def stepped(self, optimizer, args, kwargs) -> None:
        if self.step is None:
            self.step = self.current
            sys.setprofile(None)


def spine(step: Call) -> list[Call]:
    chain = []
    while step is not None and step.parent is not None:
        chain.append(step)
        step = step.parent
    return chain[::-1]


def property_reads() -> set:
    """The code of every property of easyfit's classes: reading one is reading a value, not a step of the way."""
    codes = set()
    for name, module in list(sys.modules.items()):
        if name.startswith("easyfit"):
            for cls in vars(module).values():
                if isinstance(cls, type) and cls.__module__ == name:
                    codes |= {member.fget.__code__ for member in vars(cls).values() if isinstance(member, property)}
    return codes


def _leads_on(call: Call, reads: set) -> bool:
    """Whether a call is a step of the way: not a property read, and it calls on into another module."""
    return call.code not in reads and any(
        (inner.module not in (call.module, *LEAVES) and inner.code not in reads)
        or (inner.module not in LEAVES and _leads_on(inner, reads)) for inner in call.calls)


def path(recorder: Recorder) -> list[tuple[str, str, bool]]:
    """(module, function, whether entered by a call rather than a return) in the order the path enters them;
    consecutive entries within one module merged."""
    chain, entered, reads = spine(recorder.step), [], property_reads()
    caller = recorder.root
    for call in chain:
        for side in caller.calls:
            if side is call:
                break
            if side.module not in (caller.module, *LEAVES) and _leads_on(side, reads):
                entered += [(side.module, side.function, True), (caller.module, caller.function, False)]
        if call.module not in LEAVES:   # a helper the call passes through (a public call's own wrapper)
            entered.append((call.module, call.function, True))
        caller = call
    merged = []
    for entry in entered:
        if not merged or merged[-1][0] != entry[0]:
            merged.append(entry)
    return merged


def counts(steps: list[tuple[str, str, bool]]) -> tuple[int, int, int]:
    """(main modules passed, calls into a module the way had already left, entries into such a module by a call or
    a return alike)."""
    left, doubled, revisits = set(), 0, 0
    for (previous, _, _), (module, _, by_call) in zip(steps, steps[1:]):
        left.add(previous)
        doubled += by_call and module in left
        revisits += module in left
    return len({module for module, _, _ in steps}), doubled, revisits


def plan_modules(recorder: Recorder) -> list[str]:
    """The modules `plan_call` and the easyfit calls under it enter (the utils helpers and property reads left out),
    sorted."""
    reads = property_reads()
    def find(call: Call) -> Call | None:
        if call.function == "plan_call":
            return call
        return next((found for inner in call.calls if (found := find(inner)) is not None), None)

    def modules(call: Call) -> set:
        return {call.module}.union(*(modules(inner) for inner in call.calls if inner.code not in reads)) - set(LEAVES)
    plan = find(recorder.root)
    return sorted(modules(plan)) if plan is not None else []


def crossings(call: Call, module: str | None = None) -> list[str]:
    """The modules entered by every call between two easyfit modules under `call`, in order (a helper of utils/ is
    part of its caller). A function one call runs again and again (a loop: the polls of the ranks' readiness, whose
    number is a matter of timing) counts at its first run."""
    entered, seen = [], set()
    for inner in call.calls:
        if inner.code in seen:
            continue
        seen.add(inner.code)
        inner_module = module if inner.module.startswith("utils/") else inner.module
        if inner_module != module and inner_module is not None:
            entered.append(inner_module)
        entered += crossings(inner, inner_module)
    return entered


def trace_counts(recorder: Recorder) -> tuple[int, int, int, collections.Counter]:
    """(modules entered, calls between modules, calls into a module entered before, calls by module) from fit's call
    to the first optimizer step."""
    entered = crossings(recorder.root)
    return len(set(entered)), len(entered) - 1, len(entered) - len(set(entered)), collections.Counter(entered)


def record() -> Recorder | None:
    recorder = Recorder()
    register_optimizer_step_pre_hook(recorder.stepped)
    torch.manual_seed(0)
    model = easyfit.Model(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)), "cross_entropy", "sgd")
    x, y = torch.randn(64, 4), torch.randint(0, 2, (64,))
    sys.setprofile(recorder.profile)
    placement = {} if "--single" in sys.argv else {"strategy": "ddp", "devices": 2}
    model.fit(x, y, epochs=1, batch_size=16, accelerator="cpu", verbose=0, **placement)
    sys.setprofile(None)
    return recorder if model.is_global_zero else None


def main() -> None:
    recorder = record()
    if recorder is None:   # a re-run rank
        return
    steps = path(recorder)
    if "--counts" not in sys.argv:
        for number, (module, function, by_call) in enumerate(steps, 1):
            print(f"{number}. `{module}` {function}" if by_call else f"{number}. back in `{module}`")
        print(f"{len(steps) + 1}. `optimizer.step()`")
    modules, doubled, revisits = counts(steps)
    print(f"modules {modules} doubling back {doubled} returns included {revisits}")
    planned = plan_modules(recorder)
    print(f"the plan enters {len(planned)} modules: {', '.join(planned)}")
    modules, calls, reentries, by_module = trace_counts(recorder)
    print(f"the whole trace: modules {modules} calls between modules {calls} re-entries {reentries}")
    if "--counts" not in sys.argv:
        print("; ".join(f"{module} {count}" for module, count in by_module.most_common()))


if __name__ == "__main__":
    main()
