"""Argument checks shared by the public calls: each names what was wrong and how to fix it."""
from __future__ import annotations

import difflib
import math
import numbers


def closest_name(name: str, choices) -> str:
    """' Did you mean ...?' naming the closest valid name (and a second one nearly as close), or ''."""
    scored = sorted(((difflib.SequenceMatcher(None, name, choice).ratio(), choice) for choice in choices), reverse=True)
    matches = [choice for score, choice in scored[:2] if score >= max(0.6, scored[0][0] - 0.15)]
    return f" Did you mean {' or '.join(repr(match) for match in matches)}?" if matches else ""


def check_positive_int(value, name: str, expected: str = "a positive integer") -> None:
    """Raise unless `value` is an int >= 1 (a bool is not a count); `expected` words the rule in the message."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be {expected}, got {value!r}")


def check_positive_number(value, name: str, expected: str = "a positive number") -> None:
    """Raise unless `value` is a finite real number > 0 (not a bool, not NaN)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0 < value < math.inf:
        raise ValueError(f"{name} must be {expected}, got {value!r}")
