"""The shape of the code: every module imports on its own, the import graph (lazy imports inside functions
included) has no cycle, and no module grows past 400 lines."""
from __future__ import annotations

import ast
import importlib
import pathlib
import re
import subprocess
import sys

import pytest
from code_scan import parse

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "easyfit"
MAX_LINES = 400


def module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def imported_modules(name: str, path: pathlib.Path) -> set[str]:
    """The easyfit modules `name` imports anywhere in its code (a package counts as its __init__)."""
    found = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(parse(path)):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:   # a relative import: from the package, `level - 1` packages up
                parents = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(parents + ([base] if base else []))
            targets = [f"{base}.{alias.name}" for alias in node.names] + [base]
        else:
            continue
        found.update(target for target in targets if target in MODULES and target != name)
    return found


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a list of modules (the first repeated at the end), or None."""
    state: dict[str, int] = {}   # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for target in sorted(graph[node]):
            if state.get(target) == 1:
                return path[path.index(target):] + [target]
            if target not in state and (cycle := visit(target)):
                return cycle
        state[node] = 2
        path.pop()
        return None
    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_import_graph_has_no_cycle():
    graph = {name: imported_modules(name, path) for name, path in MODULES.items()}
    # a package's __init__ importing its own submodules is how a package exposes them, not a cycle
    graph = {name: {target for target in targets if not target.startswith(name + ".")}
             for name, targets in graph.items()}
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


@pytest.mark.parametrize("name", sorted(MODULES))
def test_every_module_imports(name):
    importlib.import_module(name)


def test_no_module_is_over_400_lines():
    long = {name: count for name, path in MODULES.items()
            if (count := len(path.read_text(encoding="utf-8").splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines (split them by job): {long}"


#: the layers, bottom first: a module imports only from its own layer or the layers below it (docs/architecture.md).
#: A module belongs to the longest layer name that prefixes it; `easyfit` itself is the public surface on top.
LAYERS = [
    "easyfit.utils",
    "easyfit.parts",
    "easyfit.data",
    "easyfit.callbacks",
    "easyfit.saving",
    "easyfit.distributed",
    "easyfit.compiled",
    "easyfit.training",
    "easyfit.tuning",
    "easyfit",
]


def layer_of(module: str) -> int:
    return max((index for index, layer in enumerate(LAYERS) if module == layer or module.startswith(layer + ".")),
               key=lambda index: len(LAYERS[index]))


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """Each import of a module from a layer above its own, as 'importer (layer) -> imported (layer)'."""
    return [f"{name} ({LAYERS[layer_of(name)]}) -> {target} ({LAYERS[layer_of(target)]})"
            for name, targets in sorted(graph.items()) for target in sorted(targets)
            if layer_of(target) > layer_of(name)]


def test_no_layer_imports_one_above_it():
    graph = {name: imported_modules(name, path) for name, path in MODULES.items()}
    upward = upward_imports(graph)
    assert not upward, "imports from a layer above (move the code down, or pass it in):\n" + "\n".join(upward)


def test_the_layer_check_finds_an_upward_import():
    assert upward_imports({"easyfit.utils.checks": {"easyfit.training.loop"}}) == [
        "easyfit.utils.checks (easyfit.utils) -> easyfit.training.loop (easyfit.training)"]
    assert upward_imports({"easyfit.training.loop": {"easyfit.utils.checks"}}) == []


#: the modules at the top of the package: the public paths users import (docs/architecture.md, "Map")
PUBLIC_FACES = {"__init__.py", "model.py", "strategies.py", "launchers.py", "devices.py", "checkpoint_convert.py"}


def test_the_top_of_the_package_holds_only_the_public_faces():
    entries = {path.name for path in PACKAGE.iterdir() if not path.name.startswith((".", "__pycache__"))}
    layers = {layer.split(".")[1] for layer in LAYERS if "." in layer}
    assert entries <= PUBLIC_FACES | layers, (f"{sorted(entries - PUBLIC_FACES - layers)} at the top of easyfit/: "
                                              "put code in the layer of its job")


def missing_names(name: str, path: pathlib.Path) -> list[str]:
    """Each `from easyfit.X import y` in `name` (anywhere in its code, lazy imports too) whose `y` is neither a name
    of module X nor a submodule of it, as 'name: from X import y'."""
    missing = []
    for node in ast.walk(parse(path)):
        if not isinstance(node, ast.ImportFrom) or node.level or node.module not in MODULES:
            continue
        module = importlib.import_module(node.module)
        missing += [f"{name}: from {node.module} import {alias.name}" for alias in node.names
                    if not hasattr(module, alias.name) and f"{node.module}.{alias.name}" not in MODULES]
    return missing


def test_every_imported_name_exists():
    missing = [line for name, path in MODULES.items() for line in missing_names(name, path)]
    assert not missing, "imports of names that do not exist:\n" + "\n".join(missing)


def test_the_name_check_finds_a_missing_name(tmp_path):
    stale = tmp_path / "stale.py"
    stale.write_text("def f():\n    from easyfit.distributed.launchers import child_started\n")
    assert missing_names("stale", stale) == ["stale: from easyfit.distributed.launchers import child_started"]


#: the most modules the plan of a 2-process ddp fit may enter (docs/architecture.md, "The way of a fit")
PLAN_MODULES = 29
#: the most modules the whole trace of rank 0 of that fit may enter, and calls into a module it entered before
TRACE_MODULES, TRACE_REENTRIES = 60, 135


def test_the_way_of_a_fit_in_the_docs_is_the_way_a_fit_takes():
    """docs/architecture.md's numbered way from fit to the optimizer step is what scripts/fit_path.py records on rank 0
    of a real 2-process ddp fit, within the bounds the design keeps (at most 12 modules, 10 entries into a module
    already left, returns to a caller included; the plan itself at most PLAN_MODULES modules; the whole trace at most
    TRACE_MODULES modules and TRACE_REENTRIES re-entries)."""
    root = pathlib.Path(__file__).parents[1]
    done = subprocess.run([sys.executable, str(root / "scripts" / "fit_path.py")], capture_output=True, text=True,
                          timeout=300, cwd=root)
    assert done.returncode == 0, done.stderr
    recorded = [line for line in done.stdout.splitlines() if line[:1].isdigit()]
    doc = (root / "docs" / "architecture.md").read_text()
    documented = doc.split("<!-- fit path: scripts/fit_path.py -->\n")[1].split("\n<!-- end of fit path -->")[0]
    assert recorded == documented.splitlines(), "the way changed: paste scripts/fit_path.py's list into the docs"
    counts = re.search(r"modules (\d+) doubling back (\d+) returns included (\d+)", done.stdout).groups()
    modules, doubled, revisits = map(int, counts)
    assert modules <= 12 and doubled <= 10 and revisits <= 10
    planned = int(re.search(r"the plan enters (\d+) modules", done.stdout)[1])
    assert planned <= PLAN_MODULES, f"the plan of a ddp fit enters {planned} modules (bound {PLAN_MODULES})"
    traced, _, reentries = map(int, re.search(r"the whole trace: modules (\d+) calls between modules (\d+) "
                                               r"re-entries (\d+)", done.stdout).groups())
    assert traced <= TRACE_MODULES and reentries <= TRACE_REENTRIES, (traced, reentries)


#: the modules outside easyfit.compiled that import it, each inside the function that runs under compile= only
COMPILED_DOORS = {"easyfit.training.steps", "easyfit.training.plan"}


def imports_of_compiled(path: pathlib.Path) -> list[tuple[int, bool]]:
    """(line, at the module's top level) of each import of easyfit.compiled in the file at `path`."""
    tree = parse(path)
    top = {id(node) for node in tree.body}
    found = []
    for node in ast.walk(tree):
        names = [alias.name for alias in node.names] if isinstance(node, ast.Import) else \
            [node.module or ""] if isinstance(node, ast.ImportFrom) else []
        if any(name == "easyfit.compiled" or name.startswith("easyfit.compiled.") for name in names):
            found.append((node.lineno, id(node) in top))
    return found


def test_the_compiled_steps_are_imported_only_by_their_doors_inside_functions():
    """Above easyfit.compiled, only the call's steps and the plan import it, lazily: a fit without compile= loads
    none of it (tests/test_import.py runs one in a fresh interpreter)."""
    outside = {name: found for name, path in MODULES.items()
               if not name.startswith("easyfit.compiled") and (found := imports_of_compiled(path))}
    assert set(outside) <= COMPILED_DOORS, f"easyfit.compiled imported beyond its doors: {sorted(outside)}"
    at_top = [f"{name}:{line}" for name, found in outside.items() for line, top in found if top]
    assert not at_top, f"easyfit.compiled imported when the module loads: {at_top}"
    assert imports_of_compiled(PACKAGE / "training" / "steps.py"), "the check no longer sees the steps' door"
