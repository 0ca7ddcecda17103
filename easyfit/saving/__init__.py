"""Checkpoints, resume and restarts.

- `checkpoint`: atomic checkpoint files, loaded as data.
- `model_state`: a Model's whole training state as one checkpoint dict.
- `net_weights`: weight files and numpy weight lists.
- `resume`: where a mid-epoch checkpoint stopped, and the batches left.
- `convert`: a sharded checkpoint folder to one file (public path: easyfit.checkpoint_convert).
- `fault_tolerance`, `slurm_requeue`: a fit's own checkpoints under restarting launchers and SLURM.
"""
