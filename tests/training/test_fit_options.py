"""fit's own options are declared once (easyfit.training.fit_options): a new one is one row, found in fit's and the
finders' signatures and help, in the plan's checks, in the loop's settings and in the compiled programs' key; fit's
signature keeps its order and kinds."""
from __future__ import annotations

import inspect
import subprocess
import sys

import pytest
import torch
from compile_paths import fast_path

import easyfit

P, K = inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY
#: fit's own arguments and options as they were written by hand before the declarations: names, order and kinds
FIT_SIGNATURE = [("x", P), ("y", P), ("batch_size", P), ("epochs", P), ("verbose", P), ("callbacks", P),
                 ("validation_split", P), ("validation_data", P), ("shuffle", P), ("class_weight", P),
                 ("sample_weight", P), ("initial_epoch", P), ("steps_per_epoch", P), ("validation_steps", P),
                 ("validation_batch_size", P), ("validation_freq", P), ("seed", K), ("resume_from", K),
                 ("gradient_accumulation_steps", K), ("gradient_clip_val", K), ("lr_scaling", K),
                 ("lr_warmup_epochs", K), ("max_restarts", K), ("fault_tolerance", K),
                 ("fault_tolerance_every_n_steps", K), ("steps_per_execution", K)]


def test_fit_keeps_the_order_and_kinds_of_its_arguments():
    parameters = list(inspect.signature(easyfit.Model.fit).parameters.values())[1:len(FIT_SIGNATURE) + 1]
    assert [(p.name, p.kind) for p in parameters] == FIT_SIGNATURE


def test_positional_options_bind_in_order_and_a_second_value_is_refused():
    model, seen = easyfit.Model(torch.nn.Linear(2, 2)), {}
    model._dispatch = lambda kind, run, x, y, options: seen.update(options=options)
    x, y = torch.randn(4, 2), torch.tensor([0, 1, 0, 1])
    model.fit(x, y, 2, 3, 0, [], gradient_accumulation_steps=2, devices=1)
    options = seen["options"]
    assert (options.batch_size, options.epochs, options.verbose, options.callbacks,
            options.gradient_accumulation_steps) == (2, 3, 0, [], 2)
    with pytest.raises(TypeError, match="multiple values for argument 'batch_size'"):
        model.fit(x, y, 2, batch_size=4)
    with pytest.raises(TypeError, match="at most 16 positional arguments"):
        model.fit(x, y, *range(1, 16))


#: a fit option added in its one declaration (a fresh interpreter), then looked for everywhere fit's options go
FAKE_FIT_OPTION = """
import importlib, inspect, warnings
import torch
from easyfit.compiled import steps as compiling
from easyfit.training import fit_options

def check(value, name):
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")

fake = fit_options.FitOption("fake_fit_option", 7, "a made-up fit option", check, keyword_only=True, setting=True,
                             in_step_key=True)
fit_options.FIT_OPTIONS.append(fake)
fit_options.TrainingSettings.rows.insert(-len(fit_options.LOOP_SETTINGS), fake)   # made of FIT_OPTIONS at import
from easyfit import model as model_module
importlib.reload(model_module)   # the calls are declared again, as in a fresh interpreter
Model = model_module.Model
for name in ("fit", "find_lr", "find_batch_size"):
    call = getattr(Model, name)
    parameter = inspect.signature(call).parameters["fake_fit_option"]
    assert parameter.default == 7 and parameter.kind is inspect.Parameter.KEYWORD_ONLY, name
    assert "fake_fit_option: a made-up fit option (default 7)" in inspect.getdoc(call), name

x, y = torch.randn(8, 2), torch.tensor([0, 1] * 4)
for call, arguments in ((Model.fit, {}), (Model.find_lr, {"num_steps": 2}), (Model.find_batch_size,
                                                                              {"max_batch_size": 4})):
    try:   # the plan checks it, for fit and for the finders' trial fits
        call(Model(torch.nn.Linear(2, 2)), x, y, fake_fit_option=-1, devices=1, **arguments)
    except ValueError as error:
        assert "fake_fit_option must be >= 0, got -1" in str(error), error
    else:
        raise AssertionError(f"{call.__name__} did not check fake_fit_option")

seen, keys = [], []
configure = compiling.CompiledSteps._cached

class Keyed(BaseException):   # raised once the programs' key is made: nothing needs compiling to read it
    pass

def cached(self, key, build):
    keys.append(key)
    if key[0] == "programs":
        raise Keyed
    return configure(self, key, build)

compiling.CompiledSteps._cached = cached
from easyfit.distributed.strategies.base import Strategy
setup = Strategy.setup
def recording_setup(self, net, optimizer, scheduler=None, settings=None, call=None):
    seen.append(settings)
    return setup(self, net, optimizer, scheduler, settings, call)

Strategy.setup = recording_setup
model = Model(torch.nn.Linear(2, 2), optimizer="sgd")
try:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.fit(x, y, batch_size=4, verbose=0, devices=1, compile=True, fake_fit_option=8)
except Keyed:
    pass
assert seen[-1].fake_fit_option == 8, seen
assert seen[-1].step_key() == (("gradient_clip_val", None), ("fake_fit_option", 8))
programs = [key for key in keys if key[0] == "programs"]
assert programs and programs[-1][-1] == seen[-1].step_key(), keys
print("found everywhere")
"""


@fast_path
def test_a_fit_option_declared_once_reaches_fit_the_finders_their_help_the_plan_the_loop_and_the_step_key():
    done = subprocess.run([sys.executable, "-c", FAKE_FIT_OPTION], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "found everywhere" in done.stdout


@pytest.mark.parametrize("name", ["shuffle", "verbose", "lr_scaling"])
def test_find_batch_size_refuses_by_name_the_options_its_trials_set(name):
    model = easyfit.Model(torch.nn.Linear(2, 2))
    assert name not in inspect.signature(easyfit.Model.find_batch_size).parameters
    with pytest.raises(TypeError, match=f"find_batch_size runs its own short trials; it takes no {name}"):
        model.find_batch_size(torch.randn(8, 2), torch.tensor([0, 1] * 4), max_batch_size=4, **{name: 0})


def test_fit_options_are_read_only_and_the_plan_completes_a_copy():
    from easyfit.distributed.run_options import RunOptions
    from easyfit.training.fit_options import FitOptions
    from easyfit.training.on_rank import FIT
    from easyfit.training.plan import plan_call
    given = FitOptions(callbacks=None, validation_data=[torch.zeros(2, 2), torch.zeros(2)])
    with pytest.raises(AttributeError, match="fit options are read-only"):
        given.epochs = 3
    plan = plan_call(easyfit.Model(torch.nn.Linear(2, 2)), FIT, RunOptions(devices=1), given)
    assert plan.options.callbacks == [] and isinstance(plan.options.validation_data, tuple)
    assert plan.options.max_restarts == 0
    assert given.callbacks is None and isinstance(given.validation_data, list) and given.max_restarts is None
