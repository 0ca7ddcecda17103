"""Static scans of easyfit's own code for the tests: which calls stand where, by module and enclosing function."""
from __future__ import annotations

import ast
import pathlib
from typing import Callable

import easyfit

PACKAGE = pathlib.Path(easyfit.__file__).parent


def parse(path: pathlib.Path) -> ast.Module:
    """The syntax tree of the Python file at `path`. CPython 3.11's `ast.parse` can fail with a spurious
    "AST constructor recursion depth mismatch" SystemError when another thread of the process parses meanwhile
    (CPython gh-106905; a pytest worker keeps threads of earlier tests): it is tried once more then."""
    source = path.read_text(encoding="utf-8")
    try:
        return ast.parse(source, str(path))
    except SystemError as error:
        if "recursion depth mismatch" not in str(error):
            raise
        return ast.parse(source, str(path))


class CallsByFunction(ast.NodeVisitor):
    """Collects (enclosing function, line) of each call that `wanted` accepts ("" outside any function)."""

    def __init__(self, wanted: Callable[[ast.Call], bool]):
        self.wanted, self.functions, self.found = wanted, [""], []

    def visit_FunctionDef(self, node):
        self.functions.append(node.name)
        self.generic_visit(node)
        self.functions.pop()

    def visit_Call(self, node):
        if self.wanted(node):
            self.found.append((self.functions[-1], node.lineno))
        self.generic_visit(node)


def calls_in_easyfit(wanted: Callable[[ast.Call], bool]) -> list[tuple[str, str, int]]:
    """(module path in easyfit/, enclosing function, line) of every call in easyfit that `wanted` accepts."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        calls = CallsByFunction(wanted)
        calls.visit(parse(path))
        found += [(path.relative_to(PACKAGE).as_posix(), function, line) for function, line in calls.found]
    return found
