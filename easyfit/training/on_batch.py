"""Keras' single-batch calls: `train_on_batch`, `test_on_batch` and `predict_on_batch` run fit, evaluate and predict
on exactly one batch (a mixin of easyfit.Model)."""
from __future__ import annotations

from easyfit.data.results import scores_result
from easyfit.distributed.run_options import RunOptions, takes_run_options
from easyfit.saving.model_state import kept
from easyfit.utils.tensors import sample_count


class OnBatchCalls:
    """The *_on_batch calls of a Model."""

    @takes_run_options(devices=1)
    def train_on_batch(self, x, y=None, sample_weight=None, class_weight=None, return_dict=False, **run_options):
        """One optimizer step on exactly this batch; its loss (and metrics) as `evaluate` returns them.
        `history` and `completed_epochs` are left as they were.

        Args:
            x, y: one batch, as arrays or tensors.
            sample_weight: one weight per sample (default None).
            class_weight: {class index: weight} (default None).
            return_dict: {"loss": ..., ...} instead of a list (default False).
        """
        run = RunOptions.given(run_options, "OnBatchCalls.train_on_batch")
        with kept(self, ("history", "completed_epochs", "_callbacks")):   # a step, not an epoch of the history
            result = self.fit(x, y, epochs=1, batch_size=sample_count(x), shuffle=False, verbose=0, lr_scaling=None,
                              fault_tolerance=False, sample_weight=sample_weight, class_weight=class_weight,
                              **run.keywords())
        logs = {key: values[-1] for key, values in result.history.items()}
        return scores_result(logs, self.metrics.names, return_dict)

    @takes_run_options(devices=1)
    def test_on_batch(self, x, y=None, return_dict=False, **run_options):
        """`evaluate` on exactly this batch.

        Args:
            x, y: one batch, as arrays or tensors.
            return_dict: {"loss": ..., ...} instead of a list (default False).
        """
        run = RunOptions.given(run_options, "OnBatchCalls.test_on_batch")
        return self.evaluate(x, y, batch_size=sample_count(x), verbose=0, return_dict=return_dict, **run.keywords())

    @takes_run_options(devices=1)
    def predict_on_batch(self, x, **run_options):
        """`predict` on exactly this batch.

        Args:
            x: one batch of inputs, as arrays or tensors.
        """
        run = RunOptions.given(run_options, "OnBatchCalls.predict_on_batch")
        return self.predict(x, batch_size=sample_count(x), verbose=0, **run.keywords())
