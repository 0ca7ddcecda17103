"""Checkpoints and resume.

- `checkpoint`: atomic checkpoint files that hold data only, read as data (`trusted=True`: a file the caller trusts).
- `backend_folders`: FSDP's and DeepSpeed's own checkpoint folders, checked as data before the backend reads them.
- `model_state`: a Model's whole training state as one checkpoint dict.
- `net_weights`: weight files and numpy weight lists.
- `resume`: where a mid-epoch checkpoint stopped, and the batches left.
- `convert`: a sharded checkpoint folder, or an older file, to one data-only file (public path:
  easyfit.checkpoint_convert).
"""
