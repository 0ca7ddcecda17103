"""torch's internals behind one door (easyfit/utils/torch_internals.py): no other module reaches into Dynamo,
AOTAutograd or inductor, and on a torch outside the tested releases `compile=` trains with eager's numbers after a
one-time notice."""
from __future__ import annotations

import ast
import warnings

import pytest
import torch
from code_scan import PACKAGE, parse
from torch import nn

import easyfit
from easyfit.utils import torch_internals

#: torch's compiler internals: only the door may import or read them
INTERNAL = ("torch._dynamo", "torch._inductor", "torch._functorch", "torch._subclasses", "torch._guards",
            "torch._TorchCompile")
DOOR = PACKAGE / "utils" / "torch_internals.py"


def dotted(node: ast.AST) -> str:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    return ".".join([node.id, *reversed(parts)]) if isinstance(node, ast.Name) else ""


def internal_uses(tree: ast.Module) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            names = [node.module or ""]
        elif isinstance(node, ast.Attribute):
            names = [dotted(node)]
        found += [(node.lineno, name) for name in names if name.startswith(INTERNAL)]
    return found


def test_only_the_door_reaches_into_torchs_compiler_internals():
    found = [f"{path.relative_to(PACKAGE)}:{line} {name}" for path in sorted(PACKAGE.rglob("*.py")) if path != DOOR
             for line, name in internal_uses(parse(path))]
    assert not found, found


@pytest.mark.skipif(torch_internals.plain_compile_asked(), reason="EASYFIT_PLAIN_COMPILE=1 runs the fallback")
def test_the_running_torch_is_a_tested_release():
    """CI runs the suite on releases the door names (the newest in the main environment, the one torchvision pairs
    with in the vision one); the floor's and the XLA environment's tests run with EASYFIT_PLAIN_COMPILE=1."""
    assert torch_internals.internals_tested(), torch_internals.untested_reason()


def fitted(compile_option) -> nn.Module:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Dropout(0.25), nn.Linear(16, 3))
    x, y = torch.randn(48, 6), torch.randint(0, 3, (48,))
    model = easyfit.Model(net, "cross_entropy", "sgd", lr=0.1)
    model.fit(x, y, epochs=2, batch_size=16, shuffle=False, verbose=0, compile=compile_option)
    return net


def test_on_an_untested_torch_compile_trains_with_eagers_numbers_after_one_notice(monkeypatch):
    monkeypatch.setattr(torch_internals, "TESTED_TORCH", ("0.1",))   # the running torch is now "untested"
    monkeypatch.setattr(torch_internals, "_noticed", set())
    eager = fitted(False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compiled = fitted(True)
        again = fitted(True)
    notices = [str(w.message) for w in caught if torch_internals.untested_reason() in str(w.message)]
    assert len(notices) == 1 and "plain torch.compile" in notices[0], notices
    for trained in (compiled, again):
        for (name, value), expected in zip(trained.state_dict().items(), eager.state_dict().values()):
            torch.testing.assert_close(value, expected, rtol=1e-5, atol=1e-5, msg=name)


@pytest.mark.parametrize("version, tested", [("2.15.0+cu132", True), ("2.14.1", True), ("2.16.0", False),
                                             ("2.13.0+cpu", False)])
def test_the_release_is_read_without_its_local_suffix(monkeypatch, version, tested):
    monkeypatch.setattr(torch, "__version__", version)
    monkeypatch.delenv(torch_internals.PLAIN_COMPILE, raising=False)
    assert torch_internals.internals_tested() is tested
