"""The user docs hold together: every relative link in README.md, CONTRIBUTING.md and docs/*.md leads to a file that
exists (and to a heading there, when it names one), and docs/api.md's tables of the run options and of fit's own list
them as they are declared (easyfit/distributed/run_options.py, easyfit/training/fit_options.py), with their
defaults."""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from easyfit.distributed.run_options import OPTIONS
from easyfit.training.fit_options import FIT_OPTIONS

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
API = ROOT / "docs" / "api.md"


def anchors(path: Path) -> set[str]:
    """The anchors GitHub gives a Markdown file's headings: lower case, punctuation dropped, spaces as hyphens."""
    text = re.sub(r"```.*?```", "", path.read_text(encoding="utf-8"), flags=re.DOTALL)
    headings = re.findall(r"^#+ (.+)$", text, re.MULTILINE)
    return {re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-") for heading in headings}


def relative_links(path: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", path.read_text(encoding="utf-8"), flags=re.DOTALL)   # code blocks hold no links
    return [target for target in LINK.findall(text) if not re.match(r"[a-z]+:", target)]


@pytest.mark.parametrize("doc", DOCS, ids=lambda doc: str(doc.relative_to(ROOT)))
def test_every_relative_link_resolves(doc):
    broken = []
    for target in relative_links(doc):
        file, _, anchor = target.partition("#")
        linked = (doc.parent / file).resolve() if file else doc
        if not linked.exists():
            broken.append(f"{target}: no such file")
        elif anchor and linked.suffix == ".md" and anchor.lower() not in anchors(linked):
            broken.append(f"{target}: no heading #{anchor} in {linked.name}")
    assert not broken, f"{doc.name}: {broken}"


def options_table(section: str) -> dict[str, str]:
    """A table of options in docs/api.md: {option: its default as written}."""
    return dict(re.findall(r"^\| `(\w+)` \| `([^`]+)` \|", section, re.MULTILINE))


def run_options_table() -> dict[str, str]:
    """docs/api.md's "## Run options" table."""
    return options_table(API.read_text(encoding="utf-8").split("\n## Run options\n")[1].split("\n## ")[0])


def fit_options_table() -> dict[str, str]:
    """docs/api.md's table of fit's own options (the one followed by "plus the run options")."""
    before = API.read_text(encoding="utf-8").split("\nplus the [run options](#run-options).")[0]
    return options_table(before.rsplit("| option | default | meaning |", 1)[1])


@pytest.mark.parametrize("table, declared, where", [
    (run_options_table, OPTIONS, "easyfit/distributed/run_options.py's OPTIONS"),
    (fit_options_table, FIT_OPTIONS, "easyfit/training/fit_options.py's FIT_OPTIONS")], ids=["run", "fit"])
def test_each_options_table_lists_each_declared_option_with_its_default(table, declared, where):
    rows = table()
    assert list(rows) == [option.name for option in declared], f"docs/api.md's table must list {where}, in order"
    for option in declared:
        assert ast.literal_eval(rows[option.name]) == option.default, option.name
