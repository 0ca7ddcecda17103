"""The step loop and what runs inside it, and what a call does in one process.

- `options`: the options of fit / evaluate / predict, their defaults and checks.
- `in_process`: a call on one rank: batches, the strategy's setup, the loop, the hand-back.
- `loop`: the epoch / step loop, backend-blind (every backend act goes through the Strategy).
- `first_batch`: the checks of the first real step.
- `compiling`: compiled steps (`compile=`).
- `lockstep`: evaluation in step across ranks for a sharded net.
- `summary`: the layer table of `model.summary`.
"""
