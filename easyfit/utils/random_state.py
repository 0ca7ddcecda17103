"""The process-wide random state a seeded script sets, taken as it is and put back in another process."""
from __future__ import annotations

import random

import numpy as np
import torch


class GlobalRandomState:
    """torch's CPU generator, CUDA's (each device's state once CUDA is in use, else the seed CUDA will start from),
    numpy's global generator and Python's `random`, as they are now; picklable."""

    def __init__(self):
        self.torch = torch.get_rng_state()
        self.cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
        # torch.manual_seed(s) seeds CUDA's generators with s when CUDA starts: s is torch's initial seed
        self.cuda_seed = torch.initial_seed()
        self.numpy = np.random.get_state()
        self.python = random.getstate()

    def restore(self) -> None:
        """Make this process draw what the process that took the state would have drawn next."""
        torch.set_rng_state(self.torch)
        if self.cuda is None:
            torch.cuda.manual_seed_all(self.cuda_seed)   # lazy: does not start CUDA
        else:
            for index, state in enumerate(self.cuda[:torch.cuda.device_count()]):
                torch.cuda.set_rng_state(state, index)
        np.random.set_state(self.numpy)
        random.setstate(self.python)
