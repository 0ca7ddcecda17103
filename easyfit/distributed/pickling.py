"""Find what cannot be pickled, by attribute path, before spawning processes that need to pickle it."""
from __future__ import annotations

import pickle
from collections.abc import Iterator
from typing import Any

import torch


def _picklable(obj: Any) -> bool:
    try:
        pickle.dumps(obj)
    except Exception:
        return False
    return True


def _children(obj: Any, path: str) -> Iterator[tuple[str, Any]]:
    if isinstance(obj, torch.nn.Module):
        for name, module in obj._modules.items():
            yield f"{path}.{name}", module
        for name, value in vars(obj).items():
            if not name.startswith("_"):
                yield f"{path}.{name}", value
        for name in ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks"):
            for key, hook in getattr(obj, name, {}).items():
                yield f"{path}.{name}[{key}]", hook
        return
    if isinstance(obj, dict):
        for key, value in obj.items():
            yield f"{path}[{key!r}]", value
    elif isinstance(obj, (list, tuple, set)):
        for index, value in enumerate(obj):
            yield f"{path}[{index}]", value
    elif hasattr(obj, "__self__") and hasattr(obj, "__func__"):   # a bound method: look inside its object
        yield path.rsplit(".", 1)[0] if "." in path else path, obj.__self__
    elif hasattr(obj, "__dict__"):
        for name, value in vars(obj).items():
            yield f"{path}.{name}", value


def find_unpicklable(obj: Any, path: str, seen: set | None = None) -> tuple[str, Any] | None:
    """The deepest attribute path below `path` whose value cannot be pickled, or None if `obj` pickles."""
    seen = set() if seen is None else seen
    if id(obj) in seen or _picklable(obj):
        return None
    seen.add(id(obj))
    for child_path, child in _children(obj, path):
        found = find_unpicklable(child, child_path, seen)
        if found is not None:
            return found
    return path, obj


def describe(value: Any) -> str:
    name = getattr(value, "__qualname__", None) or getattr(value, "__name__", None)
    return f"<{name}>" if name else f"<{type(value).__name__} object>"


def public_name(model, path: str) -> str:
    """The path under the name the user knows: the Model keeps the user's loss, optimizer and scheduler in private
    attributes read through properties of the public name (`_loss_fn` through `loss_fn`)."""
    first, dot, rest = path.partition(".")
    public = first.lstrip("_")
    return f"{public}{dot}{rest}" if first != public and isinstance(getattr(type(model), public, None), property) \
        else path


def check_picklable(named: dict[str, Any]) -> None:
    """Raise a TypeError naming the first attribute path that cannot be pickled (e.g. `net.head.act: <lambda>`)."""
    for name, obj in named.items():
        found = find_unpicklable(obj, name)
        if found is not None:
            path, value = found
            for own in ("model.", "plan."):   # the Model's own parts, the call's options
                path = path.replace(own, "", 1) if path.startswith(own) else path
            path = public_name(obj, path) if name == "model" else path
            raise TypeError(
                f"strategy='ddp_spawn' must pickle everything it sends to the new processes, and this cannot be "
                f"pickled: {path}: {describe(value)}. Replace it with something picklable (a def at module level "
                "instead of a lambda or a local function, no open files or locks), or use strategy='ddp' (script "
                "re-launch) or 'ddp_fork', which do not pickle.")
