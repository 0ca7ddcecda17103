"""Epoch logs and a History's series under Keras 3's keys, with the keys easyfit used before still readable for one
release (each read warns)."""
from __future__ import annotations

import warnings

import torch

#: old key -> Keras 3's key; the old key reads the new one's value with a DeprecationWarning
RENAMED = {"lr": "learning_rate"}


class Logs(dict):
    """A dict whose old keys (`RENAMED`) read their new keys' values, warning that they go away in the next release.
    The old keys are never stored, so iterating, a CSV row or a plot shows each value once, under its new key."""

    def __missing__(self, key):
        new = self._renamed(key)
        if new is None:
            raise KeyError(key)
        return self[new]

    def get(self, key, default=None):
        if dict.__contains__(self, key):
            return dict.__getitem__(self, key)
        new = self._renamed(key)
        return default if new is None else self[new]

    def __contains__(self, key) -> bool:
        return dict.__contains__(self, key) or self._renamed(key) is not None

    def __reduce__(self):
        """Pickled as a call with a plain dict, which torch.load(weights_only=True) can rebuild (see below)."""
        return type(self), (dict(self),)

    def _renamed(self, key) -> str | None:
        """The new key an old `key` stands for, with the warning; None when `key` is not an old key held here."""
        new = RENAMED.get(key) if isinstance(key, str) else None
        if new is None or not dict.__contains__(self, new):
            return None
        warnings.warn(f"the log key {key!r} is now {new!r} (Keras 3's name); {key!r} is read as {new!r} for this "
                      f"release only: read {new!r} instead", DeprecationWarning, stacklevel=3)
        return new


# a saved History (torch.save(model.history.history, path)) loads with torch.load's default weights_only=True: Logs
# is a dict that adds no state, rebuilt from a plain dict
torch.serialization.add_safe_globals([Logs])


def renamed(logs: dict) -> Logs:
    """`logs` (e.g. a History saved by an earlier release) as Logs, its old keys under their new names."""
    return Logs({RENAMED.get(key, key): value for key, value in logs.items()})
