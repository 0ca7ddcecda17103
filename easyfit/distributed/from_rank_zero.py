"""What rank 0 of spawned or forked processes hands back to the caller besides the trained state: the attributes of
the user's callbacks (TerminateOnNaN's message, a callback's own counters) and the warnings raised while it ran."""
from __future__ import annotations

import contextlib
import pickle
import warnings

import torch

from easyfit.utils.tensors import on_cpu

#: attributes that belong to the caller's own objects, never replaced by rank 0's copies (an Optuna trial: the
#: caller's is the one that talks to its study)
CALLER_OWNED = ("model", "params", "trial")


def callback_attributes(callbacks: list) -> list[dict]:
    """Each callback's attributes that can travel (picklable; tensors moved to the CPU). Nets, optimizers and other
    objects whose identity matters stay the caller's."""
    return [{name: on_cpu(value)
             for name, value in vars(callback).items() if name not in CALLER_OWNED and _travels(value)}
            for callback in callbacks]


def restore_callback_attributes(callbacks: list, attributes: list[dict] | None) -> None:
    """Give the caller's callbacks (in the order given to fit) the attributes rank 0's copies ended with."""
    for callback, values in zip(callbacks, attributes or []):
        vars(callback).update(values)


def _travels(value) -> bool:
    if isinstance(value, (torch.nn.Module, torch.optim.Optimizer)) or type(value).__module__ == "easyfit.model":
        return False   # the net, the optimizer, an easyfit Model: the caller's objects are already up to date
    try:
        pickle.dumps(value)
    except Exception:   # a file handle, a writer, a lock: stays as the caller's copy has it
        return False
    return True


@contextlib.contextmanager
def recorded_warnings(record: bool):
    """Inside the block, with `record`, warnings are kept (as the filters let them through) instead of printed: a
    list of (message, category, filename, lineno) that `reissue` shows in the caller."""
    if not record:
        yield []
        return
    kept: list[tuple] = []
    with warnings.catch_warnings(record=True) as caught:
        try:
            yield kept
        finally:
            kept.extend((str(w.message), _importable(w.category), w.filename, w.lineno) for w in caught)


def _importable(category: type) -> type:
    """A warning class the caller can unpickle: one defined in the script itself becomes UserWarning."""
    return UserWarning if category.__module__ in ("__main__", "__mp_main__") else category


def reissue(recorded: list[tuple] | None) -> None:
    """Show rank 0's warnings in the caller, where they were raised."""
    for message, category, filename, lineno in recorded or []:
        warnings.warn_explicit(message, category, filename, lineno)
