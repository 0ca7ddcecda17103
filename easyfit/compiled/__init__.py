"""Compiled steps (`compile=`), imported only by a call that asks for them (easyfit.training.steps).

- `settings`: the `compile` option as torch.compile's settings, its checks, torch.compile's arguments.
- `steps`: a call's compiled steps: the forward with the loss and the optimizer step, each compiled, kept between
  calls; the runner of whole-step programs.
- `functional_step`: forward, loss, backward and the optimizer update of one or N steps as one traced program.
- `multi_step`: an epoch's steps run N per compiled call (`steps_per_execution`): the fit's `StepRunner`.
- `direct_call`: a program called straight through its compiled graph after its first call.
- `shape_family`: the batch shapes a compiled step takes, with the dimensions seen to change dynamic.
- `eager_random`: a Dropout mask in a compiled graph drawn by one eager call, as eagerly.
- `onednn_matmul`: a compiled CPU program's matrix products through oneDNN where it is faster.
"""
