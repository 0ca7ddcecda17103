"""The calls list every option in their signatures, with the defaults the option checks use, and explain each one
in their docstrings; a misspelt keyword is refused with the name it was probably meant to be."""
from __future__ import annotations

import inspect
import pathlib

import pytest
import torch

import easyfit
from easyfit.distributed import run_options
from easyfit.training.fit_options import FIT_OPTIONS

#: a call's own arguments, besides the options dataclasses it builds
OWN = {"fit": {"x", "y"}, "evaluate": {"x", "y", "batch_size", "verbose", "callbacks", "return_dict"},
       "predict": {"x", "batch_size", "verbose", "callbacks"},
       "train_on_batch": {"x", "y", "sample_weight", "class_weight", "return_dict"},
       "test_on_batch": {"x", "y", "return_dict"}, "predict_on_batch": {"x"}}
OPTIONS = {"fit": FIT_OPTIONS}
#: the *_on_batch calls run on one device unless told otherwise
ON_BATCH_DEFAULTS = {"devices": 1}


def defaults(fit_options=()) -> dict:
    declared = {option.name: option.default for option in run_options.OPTIONS}
    return {**declared, **{option.name: option.default for option in fit_options}}


def parameters(call: str) -> dict:
    signature = inspect.signature(getattr(easyfit.Model, call))
    return {name: p.default for name, p in signature.parameters.items()
            if name not in ("self", "unknown") and name not in OWN[call]}


@pytest.mark.parametrize("call", list(OWN))
def test_the_signature_lists_every_option_with_its_default(call):
    expected = defaults(OPTIONS.get(call, ()))
    if call.endswith("_on_batch"):
        expected.update(ON_BATCH_DEFAULTS)
    assert parameters(call) == expected


@pytest.mark.parametrize("call", list(OWN))
def test_help_explains_every_argument(call):
    method = getattr(easyfit.Model, call)
    documented = inspect.getdoc(method)
    for name in inspect.signature(method).parameters:
        if name in ("self", "unknown"):
            continue
        assert f" {name}:" in documented or f" {name}," in documented, f"{call}'s docstring does not explain {name}"


def test_a_misspelt_option_is_refused_with_the_closest_name():
    model = easyfit.Model(torch.nn.Linear(2, 2))
    x, y = torch.randn(4, 2), torch.tensor([0, 1, 0, 1])
    with pytest.raises(TypeError, match=r"unexpected argument\(s\) epoch\. Did you mean 'epochs'"):
        model.fit(x, y, epoch=2)
    with pytest.raises(TypeError, match=r"unexpected argument\(s\) device\. Did you mean 'devices'"):
        model.evaluate(x, y, device=1)
    with pytest.raises(TypeError, match=r"unexpected argument\(s\) batchsize\. Did you mean 'batch_size'"):
        model.predict(x, batchsize=2)


#: a run option added in its one declaration, then looked for in every public call, `help()` and the plan
FAKE_OPTION = """
import importlib, inspect
import torch
from easyfit.distributed import launch, run_options
from easyfit.training import on_batch
fake = run_options.RunOption("fake_option", 7, "a made-up option", placement=True)
run_options.OPTIONS.append(fake)
run_options.Placement.rows.append(fake)   # the placement options' table, made of OPTIONS' rows at import
for module in (on_batch, launch):   # the calls are made again, as in a fresh interpreter
    importlib.reload(module)
from easyfit import model as model_module
importlib.reload(model_module)
from easyfit.training.on_rank import EVALUATE
from easyfit.training.plan import LoopOptions, plan_call
calls = [getattr(model_module.Model, name) for name in ("fit", "evaluate", "predict", "train_on_batch",
                                                         "test_on_batch", "predict_on_batch")] + [launch.launch]
for call in calls:
    assert inspect.signature(call).parameters["fake_option"].default == 7, call
    assert "fake_option: a made-up option (default 7)" in inspect.getdoc(call), call
model = model_module.Model(torch.nn.Linear(2, 2))
plan = plan_call(model, EVALUATE, run_options.RunOptions(fake_option=8), LoopOptions(32, 0, None))
assert plan.run.fake_option == 8 and plan.strategy.name == "single"
captured = {}
model._dispatch = lambda kind, run, *inputs: captured.setdefault("run", run)
model.predict(torch.zeros(1, 2), fake_option=9)
assert captured["run"].fake_option == 9
print("found everywhere")
"""


def test_a_run_option_declared_once_reaches_every_call_its_help_and_the_plan():
    import subprocess
    import sys
    done = subprocess.run([sys.executable, "-c", FAKE_OPTION], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "found everywhere" in done.stdout


def test_the_run_options_are_checked_before_any_work():
    model = easyfit.Model(torch.nn.Linear(2, 2))
    x, y = torch.randn(4, 2), torch.tensor([0, 1, 0, 1])
    with pytest.raises(ValueError, match="num_nodes must be a positive integer"):
        model.fit(x, y, num_nodes=0)
    with pytest.raises(TypeError, match="replace_sampler must be True or False"):
        model.evaluate(x, y, replace_sampler="yes")
    with pytest.raises(ValueError, match="unknown precision 'bf17'"):
        model.predict(x, precision="bf17")


def test_a_wrapper_put_around_a_call_without_functools_wraps_leaves_its_options_working(monkeypatch):
    """A tool or a user that spies on Model.fit with a plain wrapper (a GPU check script did) keeps fit, its
    defaults and its refusals as they were."""
    fit, seen = easyfit.Model.fit, []

    def spying_fit(self, *args, **kwargs):
        seen.append(kwargs.get("epochs"))
        return fit(self, *args, **kwargs)

    monkeypatch.setattr(easyfit.Model, "fit", spying_fit)
    x, y = torch.randn(16, 3), torch.randn(16, 1)
    model = easyfit.Model(torch.nn.Linear(3, 1), "mse", "sgd")
    assert len(model.fit(x, y, epochs=2, verbose=0, devices=1).history["loss"]) == 2 and seen == [2]
    with pytest.raises(TypeError, match="Did you mean 'devices'"):
        model.fit(x, y, verbose=0, device=1)


#: every call that takes options, with its own arguments (the rest of its signature is its options)
WRITTEN = {"fit": {"x", "y"}, "evaluate": {"x", "y", "return_dict"}, "predict": {"x"},
           "find_lr": {"x", "y", "start_lr", "end_lr", "num_steps", "smoothing", "divergence", "plot"},
           "find_batch_size": {"x", "y", "start", "max_batch_size", "max_memory", "steps"},
           **{call: OWN[call] for call in ("train_on_batch", "test_on_batch", "predict_on_batch")}}


def unwritten(call, own: set) -> list:
    """How the options a call writes in its source differ from those its declarations ask for (names, kinds and
    defaults, in order): [] when they are the same."""
    written = [(p.name, p.kind, p.default) for p in inspect.signature(call.__wrapped__).parameters.values()
               if p.name not in own | {"self", "unknown"}]
    declared = [(p.name, p.kind, p.default) for p in call.declared]
    return [] if written == declared else [written, declared]


@pytest.mark.parametrize("call", [*WRITTEN, "launch"])
def test_each_call_writes_the_options_it_declares_in_its_source(call):
    """What an editor reads (the source) is what the declarations give the checks and help()."""
    function, own = (easyfit.launch, {"max_restarts"}) if call == "launch" else (getattr(easyfit.Model, call),
                                                                                 WRITTEN[call])
    assert not unwritten(function, own), f"write {call}'s options as declared (name, kind, default, order)"


def test_an_option_declared_but_not_written_is_named():
    from easyfit.utils.options import Option, Values, takes_options

    class Two(Values):
        rows = [Option("first", 1, "one"), Option("second", None, "two", keyword_only=True)]

    @takes_options(Two)
    def call(x, first=1, **unknown):
        """A call."""
    assert unwritten(call, {"x"})
    assert inspect.signature(call).parameters["second"].default is None and "second: two" in inspect.getdoc(call)
    with pytest.raises(TypeError, match=r"call takes at most 2 positional arguments \(x, first\), got 3"):
        call(1, 2, 3)


#: what an editor completes in a call, read from the source alone (jedi, as in VS Code's Jupyter and many editors)
COMPLETED = {"model.fit(x, y, ": ["epochs=", "devices=", "strategy=", "validation_data=", "gradient_clip_val="],
             "model.evaluate(x, y, ": ["batch_size=", "return_dict=", "devices="],
             "model.predict(x, ": ["verbose=", "strategy="],
             "model.find_lr(x, y, ": ["start_lr=", "batch_size=", "devices="],
             "model.find_batch_size(x, y, ": ["max_batch_size=", "devices="],
             "model.train_on_batch(x, y, ": ["class_weight=", "devices="],
             "easyfit.launch(": ["devices=", "strategy=", "max_restarts="]}


@pytest.mark.parametrize("line", list(COMPLETED))
def test_an_editor_completes_the_options_of_a_call_from_the_source(line):
    jedi = pytest.importorskip("jedi")
    root = pathlib.Path(easyfit.__file__).resolve().parents[1]
    script = jedi.Script(f"import easyfit\nmodel = easyfit.Model(None)\n{line}", path=root / "course.py",
                         project=jedi.Project(root))
    offered = {completion.name_with_symbols for completion in script.complete(3, len(line))}
    assert set(COMPLETED[line]) <= offered, sorted(offered)
    [signature] = script.get_signatures(3, len(line))
    assert signature.name == line.split("(")[0].split(".")[1]
