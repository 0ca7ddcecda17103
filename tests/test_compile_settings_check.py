"""The check in tests/conftest.py that no test module leaves torch's compiler settings changed, run on a module that
does: a monkeypatch of an inductor option, undone by deleting the attribute (pytest 9), must fail it."""
from __future__ import annotations

import pathlib

TESTS = pathlib.Path(__file__).resolve().parent

pytest_plugins = ["pytester"]


def test_a_module_that_leaves_a_compiler_setting_changed_fails(pytester):
    pytester.makeconftest((TESTS / "conftest.py").read_text(encoding="utf-8"))
    pytester.makepyfile(nets=(TESTS / "nets.py").read_text(encoding="utf-8"))
    pytester.makepyfile(test_leaks="""
import torch._inductor.config

def test_patches_by_monkeypatch(monkeypatch):
    monkeypatch.setattr(torch._inductor.config, "fx_graph_cache", False)
""", test_clean="""
import torch._inductor.config

def test_patches_by_config_patch():
    with torch._inductor.config.patch(fx_graph_cache=False):
        pass
""")
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=2, errors=1)
    result.stdout.fnmatch_lines(["*test_leaks left torch's compiler settings changed: "
                                 "torch._inductor.config.fx_graph_cache*"])
