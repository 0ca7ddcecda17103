"""The bottom layer: helpers every other layer may use, importing nothing of easyfit's.

- `tensors`: one walk over nested tuples, lists and dicts of tensors.
- `checks`: argument checks of the public calls, each naming what was wrong and how to fix it.
- `plotting`: training curves from a History.
- `deepspeed_import`: deepspeed imported without the experiment tracker its autotuner loads.
- `random_state`: the process-wide random state (torch, CUDA, numpy, Python), taken and put back elsewhere.
"""
