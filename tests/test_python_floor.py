"""setup.py's python_requires admits no Python that easyfit's own code cannot run on."""
from __future__ import annotations

import ast
import re

from code_scan import PACKAGE, parse

SETUP = PACKAGE.parent / "setup.py"


def runtime_unions(tree: ast.Module) -> list[int]:
    """Lines of `X | Y` between types evaluated when the module runs (type aliases, isinstance arguments), which
    Python 3.10 first allows; annotations are left out (`from __future__ import annotations` keeps them text)."""
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.AnnAssign, ast.arg, ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        if (isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr)
                and all(isinstance(side, ast.Subscript) or (isinstance(side, ast.Name) and side.id[:1].isupper())
                        for side in (node.left, node.right))):
            lines.append(node.lineno)
    return lines


def test_python_requires_is_at_least_what_the_code_needs():
    floor = tuple(int(part) for part in re.search(r'python_requires=">=(\d+)\.(\d+)"',
                                                   SETUP.read_text(encoding="utf-8")).groups())
    if floor >= (3, 10):
        return
    found = [f"{path.relative_to(PACKAGE.parent)}:{line}" for path in sorted(PACKAGE.rglob("*.py"))
             for line in runtime_unions(parse(path))]
    assert not found, f"python_requires admits Python {floor}, but these lines need 3.10: {found}"
