"""The calls list every option in their signatures, with the defaults the option checks use, and explain each one
in their docstrings; a misspelt keyword is refused with the name it was probably meant to be."""
from __future__ import annotations

import inspect
from dataclasses import MISSING, fields

import pytest
import torch

import easyfit
from easyfit.training.options import FitOptions, RunOptions

#: a call's own arguments, besides the options dataclasses it builds
OWN = {"fit": {"x", "y"}, "evaluate": {"x", "y", "batch_size", "verbose", "callbacks", "return_dict"},
       "predict": {"x", "batch_size", "verbose", "callbacks"},
       "train_on_batch": {"x", "y", "sample_weight", "class_weight", "return_dict"},
       "test_on_batch": {"x", "y", "return_dict"}, "predict_on_batch": {"x"}}
OPTIONS = {"fit": (RunOptions, FitOptions)}
#: the *_on_batch calls run on one device unless told otherwise
ON_BATCH_DEFAULTS = {"devices": 1}


def defaults(*option_types) -> dict:
    return {f.name: None if f.default is MISSING else f.default for t in option_types for f in fields(t)}


def parameters(call: str) -> dict:
    signature = inspect.signature(getattr(easyfit.Model, call))
    return {name: p.default for name, p in signature.parameters.items()
            if name not in ("self", "unknown") and name not in OWN[call]}


@pytest.mark.parametrize("call", list(OWN))
def test_the_signature_lists_every_option_with_its_default(call):
    expected = defaults(*OPTIONS.get(call, (RunOptions,)))
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
