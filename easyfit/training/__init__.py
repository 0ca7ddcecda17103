"""The step loop and what runs inside it, and what a call does in one process.

- `plan`: a call's plan (strategy, its one launcher, precision) and fit's own options, every check before any work.
- `on_rank`: the body every rank runs for a call: batches, the strategy's setup, the loop, the hand-back.
- `loop`: the epoch / step loop, backend-blind (every backend act goes through the Strategy).
- `first_batch`: the checks of the first real step.
- `epoch_logs`: the epoch's loss as tensors, and the per-batch logs.
- `compiling`: compiled steps (`compile=`).
- `functional_step`: forward, loss, backward and the optimizer update of one or N steps as one traced program.
- `multi_step`: an epoch's steps run N per compiled call (`steps_per_execution`).
- `direct_call`: a program called straight through its compiled graph after its first call.
- `lockstep`: evaluation in step across ranks for a sharded net.
- `summary`: the layer table of `model.summary`.
"""
