"""Which way compile= runs here. On a torch release easyfit tested its use of torch's internals on, the fast path:
whole-step programs, N steps per call, the direct call, the graph passes. Elsewhere, and under
EASYFIT_PLAIN_COMPILE=1 (how CI runs the fallback on every torch it has), plain torch.compile of the step's parts."""
from __future__ import annotations

import pytest

from easyfit.utils.torch_internals import internals_tested, untested_reason

FAST_PATH = internals_tested()
#: a test of what only the fast path does
fast_path = pytest.mark.skipif(not FAST_PATH, reason=f"compile= runs plain torch.compile here: "
                                                     f"{untested_reason()}")
