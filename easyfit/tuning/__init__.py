"""The finders: the learning-rate range test and the batch-size search, on trial fits undone afterwards."""
