"""DDP's error for a parameter that got no gradient on a rank, in words: which parameters, why, and the fix."""
from __future__ import annotations

import re

from torch import nn

#: the start of torch DDP's error when the previous step left a gradient reduction unfinished
UNFINISHED_REDUCTION = "Expected to have finished reduction in the prior iteration"


def explain_unused_parameters(error: BaseException, net: nn.Module) -> RuntimeError | None:
    """easyfit's explanation of DDP's unused-parameter error (None for any other error)."""
    text = str(error)
    if UNFINISHED_REDUCTION not in text:
        return None
    found = re.search(r"did not receive grad for rank (\d+): ([\d ]+)", text)
    trainable = [name for name, parameter in net.named_parameters() if parameter.requires_grad]
    indices = [int(index) for index in found[2].split()] if found else []
    names = [trainable[index] for index in indices if index < len(trainable)]
    which = f"parameter(s) {', '.join(names)}" if names else "some parameters"
    rank = f"rank {found[1]}" if found else "this rank"
    return RuntimeError(
        f"{which} of the net got no gradient on {rank} in a training step (a branch of forward that this batch did "
        "not take, or an output the loss does not use), so that rank could not join the gradient all-reduce the "
        "other ranks started. DDP needs to be told to look for such parameters at every step: pass "
        "strategy=easyfit.strategies.DDP(find_unused_parameters=True) (or DDP(start_method='spawn' / 'fork', "
        "find_unused_parameters=True)); it costs a little time per step. Or make every parameter take part in "
        "every step's loss.")
