"""The step loop and what runs inside it, and what a call does in one process.

- `plan`: a call's plan (strategy, its one launcher, precision) and fit's own options, every check before any work.
- `on_rank`: the body every rank runs for a call: batches, the strategy's setup, the loop, the hand-back.
- `loop`: the epoch / step loop, backend-blind (every backend act goes through the Strategy).
- `first_batch`: the checks of the first real step.
- `epoch_logs`: the epoch's loss as tensors, and the per-batch logs.
- `steps`: how a call's steps run: the loop's own step, or compiled steps and a `StepRunner` (easyfit.compiled).
- `lockstep`: evaluation in step across ranks for a sharded net.
- `summary`: the layer table of `model.summary`.
"""
