"""compile= against eager over the space users live in (tests/training/compile_space.py): each drawn configuration
is fitted eagerly and compiled, and every History value must agree within 1e-5 (under bf16-mixed, where a traced
program rounds at other points, 2e-3, and an accuracy within 3 of its 60 samples: a near tie may flip), the weights
too where SGD carries differences as they are.

Most configurations compile with torch's "aot_eager" backend, the same traced programs as inductor (whole-step
programs, their guards, the direct call, the optimizer state and learning rates easyfit hands them) without
generating code; one in EASYFIT_COMPILE_INDUCTOR_EVERY (8 here) compiles with inductor. EASYFIT_COMPILE_CONFIGS sets
how many are drawn (16 here: a configuration takes 8-25 s on a 2-core CPU, most of it compiling; 2,000 in the soak,
scripts/compile_soak.sh), EASYFIT_COMPILE_SEED the draw.
"""
from __future__ import annotations

import os
import warnings

import pytest
import torch
from compile_space import configurations, fit

COUNT = int(os.environ.get("EASYFIT_COMPILE_CONFIGS", "16"))
SEED = int(os.environ.get("EASYFIT_COMPILE_SEED", "0"))
#: one configuration in this many compiles with inductor, the rest with aot_eager
INDUCTOR_EVERY = int(os.environ.get("EASYFIT_COMPILE_INDUCTOR_EVERY", "8"))
CONFIGS = configurations(COUNT, SEED)


@pytest.mark.parametrize("index", range(COUNT), ids=[f"{i}-{config}" for i, config in enumerate(CONFIGS)])
def test_compiled_fit_equals_eager(index):
    config = CONFIGS[index]
    backend = "inductor" if index % INDUCTOR_EVERY == INDUCTOR_EVERY - 1 else "aot_eager"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        eager_net, eager = fit(config, False)
        net, compiled = fit(config, {"backend": backend})
    for key, values in eager.items():
        tolerance = 1e-5 if config.precision != "bf16-mixed" else 0.05 if "accuracy" in key else 2e-3
        assert compiled[key] == pytest.approx(values, abs=tolerance, rel=tolerance), (key, backend)
    if config.well_conditioned and config.precision != "bf16-mixed":
        for (name, expected), actual in zip(eager_net.state_dict().items(), net.state_dict().values()):
            torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5, msg=f"{name} ({backend})")
