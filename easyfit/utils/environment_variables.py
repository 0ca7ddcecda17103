"""Reading the process's environment variables: a value without surrounding blanks, a set of them present, a
variable a launcher must have set (said in words when it did not)."""
from __future__ import annotations

import os


def env_value(name: str) -> str:
    """The variable's value without surrounding blanks; '' when unset."""
    return os.environ.get(name, "").strip()


def all_set(names) -> bool:
    return all(name in os.environ for name in names)


def required_variable(name: str, launcher: str) -> str:
    value = env_value(name)
    if not value:
        raise RuntimeError(f"{launcher} started this process but the environment variable {name} is not set; "
                           f"start the script with {launcher} as documented, or set {name} yourself.")
    return value


def int_variable(name: str, launcher: str) -> int:
    value = required_variable(name, launcher)
    try:
        return int(value)
    except ValueError:
        raise RuntimeError(f"the environment variable {name}={value!r} should be an integer.") from None
