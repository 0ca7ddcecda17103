"""Every piece of process-wide state in easyfit is documented with why it is the process's rather than a call's or a
fit's (docs/architecture.md, "Process-wide state"): each module-level mutable global (a name a function rebinds with
`global`, or a container or counter its module changes) and each value read from the process's environment at import.
Found by reading the source (ast), so a new global fails here until it is moved into a call's object or documented."""
from __future__ import annotations

import ast
import pathlib
import re

from code_scan import parse

ROOT = pathlib.Path(__file__).parents[1]
PACKAGE = ROOT / "easyfit"
DOC = ROOT / "docs" / "architecture.md"
#: calls that make a container or counter a module may change in place
MUTABLE_MAKERS = {"dict", "list", "set", "defaultdict", "OrderedDict", "Counter", "deque", "count",
                  "WeakKeyDictionary", "WeakValueDictionary"}
#: methods that change a container, or advance a counter (next(counter) is a call of `next` on it)
CHANGES = {"append", "add", "update", "pop", "popitem", "clear", "setdefault", "extend", "remove", "discard", "insert"}


def module_values(tree: ast.Module) -> dict[str, ast.expr]:
    """The names a module binds at its top level, with the value each is first given."""
    values = {}
    for statement in tree.body:
        if isinstance(statement, ast.Assign):
            targets = statement.targets
        elif isinstance(statement, ast.AnnAssign) and statement.value is not None:
            targets = [statement.target]
        else:
            continue
        for target in targets:
            if isinstance(target, ast.Name):
                values.setdefault(target.id, statement.value)
    return values


def is_mutable(value: ast.expr) -> bool:
    if isinstance(value, (ast.Dict, ast.List, ast.Set, ast.DictComp, ast.ListComp, ast.SetComp)):
        return True
    called = value.func if isinstance(value, ast.Call) else None
    return getattr(called, "id", getattr(called, "attr", None)) in MUTABLE_MAKERS


def changed_names(tree: ast.Module) -> set[str]:
    """Names the module changes in place (item assignment or deletion, a changing method) or advances with next()."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in CHANGES:
            names.add(getattr(node.func.value, "id", None))
        elif isinstance(node, ast.Call) and getattr(node.func, "id", None) == "next" and node.args:
            names.add(getattr(node.args[0], "id", None))
        elif isinstance(node, (ast.Assign, ast.AugAssign, ast.Delete)):
            targets = [node.target] if isinstance(node, ast.AugAssign) else node.targets
            names.update(target.value.id for target in targets
                         if isinstance(target, ast.Subscript) and isinstance(target.value, ast.Name))
    return names


def reads_environment(value: ast.expr) -> bool:
    """Whether a value is read from the process's environment: its working directory or a variable."""
    for node in ast.walk(value):
        called = node.func if isinstance(node, ast.Call) else None
        if getattr(called, "attr", None) in ("getcwd", "getenv"):
            return True
        if getattr(called, "attr", None) == "get" and getattr(called.value, "attr", None) == "environ":
            return True
        if isinstance(node, ast.Subscript) and getattr(node.value, "attr", None) == "environ":
            return True
    return False


def state_of(tree: ast.Module) -> set[str]:
    """The module's mutable globals (rebound with `global`, or a container or counter it changes) and values read
    from the environment at import."""
    changed = changed_names(tree)
    rebound = {name for node in ast.walk(tree) if isinstance(node, ast.Global) for name in node.names}
    return {name for name, value in module_values(tree).items()
            if name in rebound or (name in changed and is_mutable(value)) or reads_environment(value)}


def process_state() -> set[tuple[str, str]]:
    """(module path under easyfit/, name) of every module-level mutable global and value read at import."""
    return {(path.relative_to(PACKAGE).as_posix(), name) for path in sorted(PACKAGE.rglob("*.py"))
            for name in state_of(parse(path))}


def documented() -> dict[tuple[str, str], str]:
    """(module, name) -> the reason docs/architecture.md gives."""
    table = DOC.read_text().split("<!-- process-wide state: tests/test_process_state.py -->\n")[1]
    table = table.split("<!-- end of process-wide state -->")[0]
    rows = re.findall(r"^\| `([^`]+)` \| `([^`]+)` \| (.+) \|$", table, flags=re.MULTILINE)
    return {(module, name): reason.strip() for module, name, reason in rows}


def test_every_piece_of_process_wide_state_is_documented_with_its_reason():
    found, reasons = process_state(), documented()
    assert sorted(found - set(reasons)) == [], "move it into the call's or fit's object, or document why it is not"
    assert sorted(set(reasons) - found) == [], "a documented global is gone: take its row out"
    assert all(len(reason.split()) >= 5 for reason in reasons.values())


def test_the_scan_finds_what_it_looks_for():
    """A rebound global, a changed container, an advanced counter and a variable read at import are found; a table
    never changed is not."""
    source = ("import itertools, os\nTABLE = {'a': 1}\n_cache = {}\n_calls = itertools.count()\n_last = None\n"
              "HOME = os.environ.get('HOME')\n\ndef f(key):\n    global _last\n    _last = key\n"
              "    _cache[key] = next(_calls)\n")
    assert state_of(ast.parse(source)) == {"_cache", "_calls", "_last", "HOME"}
