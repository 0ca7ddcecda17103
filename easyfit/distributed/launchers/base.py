"""The launcher interface: how the ranks of a call come to exist."""
from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any, Callable


@contextlib.contextmanager
def variables_set(values: dict[str, str]) -> Iterator[None]:
    """The environment with `values` set inside the block, and each variable as it was (or unset) after it."""
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


class Launcher:
    """Starts (or joins) the ranks of a call and runs `function` in each; one failure stops them all.

    `rank_zero_in_caller`: True when this process is rank 0 itself (its objects are trained in place); False when
    rank 0 is another process, whose result and state are handed back to the caller.
    """

    rank_zero_in_caller = True

    def start(self, function: Callable, *args, **kwargs) -> Any:
        """Run `function(*args, **kwargs)` in every rank; return rank 0's result."""
        raise NotImplementedError

    def start_early(self) -> None:
        """Start the ranks now, ahead of the first call (`easyfit.launch`); nothing to do for most launchers."""
