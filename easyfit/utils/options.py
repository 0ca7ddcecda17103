"""Options declared once, as rows (name, default, doc, check, conversion), and the calls that take them.

A call writes each option it takes as a keyword parameter with its default (what an editor and `help()` read) and
ends in `**unknown`; `takes_options` names the call's tables and adds each option's doc to its docstring, and the
body reads one `Values` per table from its arguments: `options, run = given(locals(), FitOptions, RunOptions)`.
`declared` on the call holds the parameters its declarations ask for; a test holds the written signature equal."""
from __future__ import annotations

import functools
import inspect
import textwrap
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, TypeVar

from easyfit.utils.checks import closest_name

POSITIONAL, KEYWORD = inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY
F = TypeVar("F", bound=Callable)


@dataclass(frozen=True)
class Option:
    """One option: `check(value, name)` raises on a bad value before any work; `convert` brings an accepted form to
    the one easyfit uses; `keyword_only` as in the signatures of the calls taking it."""
    name: str
    default: Any
    doc: str
    check: Callable[[Any, str], None] | None = None
    convert: Callable[[Any], Any] | None = None
    keyword_only: bool = False


class Values:
    """One call's values of a table of options (`rows`), read-only attributes with the rows' defaults; a subclass
    names its rows, what they are (`title`) and what a docstring adds to the title (`note`)."""

    title: ClassVar[str] = "options"
    note: ClassVar[str] = ""
    #: the table's options, in order
    rows: ClassVar[list[Option]] = []

    def __init__(self, *positional, **values):
        names = [row.name for row in self.rows]
        values.update(zip(names, positional))
        unknown = sorted(set(values) - set(names))
        if unknown:
            raise TypeError(f"{type(self).__name__} has no option(s) {', '.join(unknown)}."
                            f"{closest_name(unknown[0], names)}")
        for row in self.rows:
            object.__setattr__(self, row.name, values.get(row.name, row.default))

    def __setattr__(self, name: str, value) -> None:
        raise AttributeError(f"{self.title} are read-only: build new ones with replace()")

    def __eq__(self, other) -> bool:
        return type(other) is type(self) and vars(other) == vars(self)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(f'{name}={value!r}' for name, value in vars(self).items())})"

    def keywords(self) -> dict:
        """Every value, as keyword arguments of a call taking them."""
        return dict(vars(self))

    def replace(self, **changes):
        return type(self)(**{**vars(self), **changes})

    def check(self) -> None:
        """Raise on a value that its row's `check` refuses."""
        for row in self.rows:
            if row.check is not None:
                row.check(getattr(self, row.name), row.name)

    def checked(self):
        """The values checked (`check`), in the forms easyfit uses (each row's `convert`)."""
        self.check()
        return type(self)(**{row.name: getattr(self, row.name) if row.convert is None else
                             row.convert(getattr(self, row.name)) for row in self.rows})


def refuse_unknown(given, known) -> None:
    """Refuse keywords a call does not take, naming the closest valid one."""
    unknown = sorted(set(given) - set(known))
    if unknown:
        raise TypeError(f"unexpected argument(s) {', '.join(unknown)}.{closest_name(unknown[0], known)} "
                        f"Valid ones: {', '.join(sorted(known))}.")


def call_arguments(arguments: dict) -> dict:
    """A call's arguments from its `locals()`: its parameters but `self`, and the keywords of its `**unknown`."""
    arguments = dict(arguments)
    arguments.pop("self", None)
    return {**arguments.pop("unknown"), **arguments}


def given(arguments: dict, *tables: type[Values]) -> list[Values]:
    """The values of each table among a call's arguments (its `locals()`, read first thing in the body); a keyword
    in `**unknown` that no table declares is refused by name."""
    declared = {row.name for table in tables for row in table.rows}
    refuse_unknown(set(arguments["unknown"]) - declared, declared | set(arguments) - {"self", "unknown"})
    arguments = call_arguments(arguments)
    return [table(**{row.name: arguments[row.name] for row in table.rows if row.name in arguments})
            for table in tables]


def documented(title: str, rows: list[Option], defaults: dict) -> str:
    """A table's part of a call's docstring, with the call's defaults."""
    lines = [textwrap.fill(f"{row.name}: {row.doc} (default {defaults[row.name]!r}).", 116,
                           initial_indent=" " * 12, subsequent_indent=" " * 16) for row in rows]
    return f"\n        {title}:\n" + "\n".join(lines) + "\n"


def takes_options(*tables: type[Values], leave_out: tuple = (), keyword_only: bool = False,
                  **defaults) -> Callable[[F], F]:
    """Declare that a call takes the options of `tables` (but `leave_out`), written in its signature in the rows'
    order with their defaults (`defaults` overrides some for this call), keyword-only where the row says so or
    `keyword_only`. The call's docstring gains each one's doc; `declared` lists the parameters they ask for."""
    def decorate(function: F) -> F:
        sections = [(table.title.capitalize() + table.note, [row for row in table.rows if row.name not in leave_out])
                    for table in tables]
        values = {row.name: defaults.get(row.name, row.default) for _, rows in sections for row in rows}
        declared = [inspect.Parameter(row.name, KEYWORD if row.keyword_only or keyword_only else POSITIONAL,
                                      default=values[row.name]) for _, rows in sections for row in rows]
        call = _refusing_extra_positionals(function)
        call.declared = sorted(declared, key=lambda parameter: parameter.kind)   # stable: the rows' order
        call.__signature__ = _with_unwritten(inspect.signature(function), call.declared)
        call.__doc__ = (function.__doc__ or "").rstrip() + "\n" + "".join(
            documented(title, rows, values) for title, rows in sections)
        return call
    return decorate


def _refusing_extra_positionals(function: Callable) -> Callable:
    """`function`, refusing more positional arguments than it takes in words: which ones it takes."""
    written = inspect.signature(function).parameters
    if "unknown" not in written:
        raise TypeError(f"{function.__qualname__} takes options, so it ends in **unknown")
    positional = [name for name, p in written.items() if p.kind is POSITIONAL]
    names = [name for name in positional if name != "self"]

    @functools.wraps(function)
    def call(*args, **keywords):
        if len(args) > len(positional):
            raise TypeError(f"{function.__name__} takes at most {len(names)} positional arguments "
                            f"({', '.join(names)}), got {len(args) - len(positional) + len(names)}")
        return function(*args, **keywords)
    return call


def _with_unwritten(signature: inspect.Signature, declared: list[inspect.Parameter]) -> inspect.Signature:
    """The signature with the declared options it does not write yet (keyword-only, before `**unknown`): a new
    option reaches the call at once, and the test of the written signatures names it."""
    written = list(signature.parameters.values())
    unwritten = [p.replace(kind=KEYWORD) for p in declared if p.name not in signature.parameters]
    return signature.replace(parameters=written[:-1] + unwritten + written[-1:])
