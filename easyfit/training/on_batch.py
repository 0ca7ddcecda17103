"""Keras' single-batch calls: `train_on_batch`, `test_on_batch` and `predict_on_batch` run fit, evaluate and predict
on exactly one batch (a mixin of easyfit.Model)."""
from __future__ import annotations

from dataclasses import replace

from easyfit.data.results import scores_result
from easyfit.distributed.run_options import RunOptions
from easyfit.saving.model_state import kept
from easyfit.utils.options import given, takes_options
from easyfit.utils.tensors import sample_count


class OnBatchCalls:
    """The *_on_batch calls of a Model."""

    @takes_options(RunOptions, devices=1)
    def train_on_batch(self, x, y=None, sample_weight=None, class_weight=None, return_dict=False, *, devices=1,
                       accelerator="auto", strategy="auto", launcher="auto", num_nodes=1, precision=None,
                       compile=False, auto_select_gpus=False, process_group_backend=None, num_workers=0,
                       replace_sampler=True, collate_fn=None, **unknown):
        """One optimizer step on exactly this batch; its loss (and metrics) as `evaluate` returns them.
        `history` and `completed_epochs` are left as they were.

        Args:
            x, y: one batch, as arrays or tensors.
            sample_weight: one weight per sample (default None).
            class_weight: {class index: weight} (default None).
            return_dict: {"loss": ..., ...} instead of a list (default False).
        """
        [run] = given(locals(), RunOptions)
        callbacks = self._last_call.callbacks   # whose states `save` writes: the last fit's, not this step's
        try:
            with kept(self, ("history", "completed_epochs")):   # a step, not an epoch of the history
                result = self.fit(x, y, epochs=1, batch_size=sample_count(x), shuffle=False, verbose=0,
                                  lr_scaling=None, fault_tolerance=False, sample_weight=sample_weight,
                                  class_weight=class_weight, **run.keywords())
        finally:
            self._last_call = replace(self._last_call, callbacks=callbacks)
        logs = {key: values[-1] for key, values in result.history.items()}
        return scores_result(logs, self.metrics.names, return_dict)

    @takes_options(RunOptions, devices=1)
    def test_on_batch(self, x, y=None, return_dict=False, *, devices=1, accelerator="auto", strategy="auto",
                      launcher="auto", num_nodes=1, precision=None, compile=False, auto_select_gpus=False,
                      process_group_backend=None, num_workers=0, replace_sampler=True, collate_fn=None, **unknown):
        """`evaluate` on exactly this batch.

        Args:
            x, y: one batch, as arrays or tensors.
            return_dict: {"loss": ..., ...} instead of a list (default False).
        """
        [run] = given(locals(), RunOptions)
        return self.evaluate(x, y, batch_size=sample_count(x), verbose=0, return_dict=return_dict, **run.keywords())

    @takes_options(RunOptions, devices=1)
    def predict_on_batch(self, x, *, devices=1, accelerator="auto", strategy="auto", launcher="auto", num_nodes=1,
                         precision=None, compile=False, auto_select_gpus=False, process_group_backend=None,
                         num_workers=0, replace_sampler=True, collate_fn=None, **unknown):
        """`predict` on exactly this batch.

        Args:
            x: one batch of inputs, as arrays or tensors.
        """
        [run] = given(locals(), RunOptions)
        return self.predict(x, batch_size=sample_count(x), verbose=0, **run.keywords())
