"""The user docs hold together: every relative link in README.md, CONTRIBUTING.md and docs/*.md leads to a file that
exists (and to a heading there, when it names one), and docs/api.md's run-options table lists the run options as
they are declared (easyfit/distributed/run_options.py), with their defaults."""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from easyfit.distributed.run_options import OPTIONS

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


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


def run_options_table() -> dict[str, str]:
    """docs/api.md's "## Run options" table: {option: its default as written}."""
    section = (ROOT / "docs" / "api.md").read_text(encoding="utf-8").split("\n## Run options\n")[1].split("\n## ")[0]
    rows = re.findall(r"^\| `(\w+)` \| `([^`]+)` \|", section, re.MULTILINE)
    return dict(rows)


def test_the_run_options_table_lists_each_declared_option_with_its_default():
    table = run_options_table()
    assert list(table) == [option.name for option in OPTIONS], \
        "docs/api.md's run-options table must list easyfit/distributed/run_options.py's OPTIONS, in their order"
    for option in OPTIONS:
        assert ast.literal_eval(table[option.name]) == option.default, option.name
