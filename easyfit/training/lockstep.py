"""Evaluation batches for a sharded net, whose forward is a collective: every rank must run as many forwards."""
from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any, Callable


def in_lockstep(batches: Iterable, strategy, spare: Callable[[], Any]) -> Iterator[tuple[Any, bool]]:
    """(batch, counted) pairs: this rank's batches (counted), then, while another rank still has batches, a batch
    run again whose results are not counted: this rank's last one, or `spare()` if it had none. One 1-element
    all-reduce per batch says whether any rank still has one."""
    iterator, last = iter(batches), None
    while True:
        batch = next(iterator, None)
        if not strategy.any_rank(batch is not None):
            return
        if batch is not None:
            last = batch
            yield batch, True
            continue
        if last is None:
            last = spare()
        if last is None:
            raise RuntimeError("this rank has no evaluation batch to run while other ranks evaluate theirs, and "
                               "the sharded net's forward needs every rank; pass in-memory data or a map-style "
                               "dataset, or at least as many evaluation samples as processes")
        yield last, False
