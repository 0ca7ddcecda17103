"""The finders: the learning-rate range test and the batch-size search, on trial fits undone afterwards."""

#: fit options find_lr's sweep sets itself
SWEEP_OPTIONS = ("epochs", "steps_per_epoch", "validation_data", "validation_split", "resume_from")
