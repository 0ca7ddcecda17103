"""The epoch / step loop. Backend-blind: every backend-specific act goes through the Strategy."""
from __future__ import annotations

import contextlib
import itertools
from dataclasses import dataclass
from typing import Any, Callable

import torch

from easyfit.callbacks.base import CallbackList
from easyfit.callbacks.logs import Logs
from easyfit.data.batches import TensorBatches, batch_source, epoch_length, peek_first_batch
from easyfit.data.contents import batch_length, call_net, split_batch
from easyfit.data.predict_inputs import PredictInputs
from easyfit.distributed.strategies.states import Fit
from easyfit.parts.item_counts import item_counting
from easyfit.parts.metrics import MetricSet
from easyfit.parts.outputs import prediction
from easyfit.parts.precision import Precision
from easyfit.training.epoch_logs import BatchLogs, LossTracker
from easyfit.training.fit_options import TrainingSettings
from easyfit.training.item_windows import CountedMean, CountedWindows, ItemSteps
from easyfit.training.lockstep import in_lockstep
from easyfit.training.steps import ModelSteps, StepRunner, step_function
from easyfit.utils.tensors import on_cpu

#: the gradient-sync context of a step that synchronises as usual (reused: a null context holds no state)
SYNC = contextlib.nullcontext()


@dataclass
class TrainingEpoch:
    """What the steps of one training epoch share."""
    batches: Any   # the epoch's batch source; its `Loop.first_steps` entry runs the fit's first batch with its checks
    tracker: LossTracker
    num_batches: int | None
    accumulate: int
    divisor: int   # the loss is divided by it for the backward (1 where the backend divides)
    batch_begin: bool
    batch_end: bool
    agree_per_step: bool   # every rank agrees after each step whether to stop
    forward_loss: Callable
    plain: Callable = None   # step_fn(net, inputs, target) of a batch after the first (see `step_function`)
    has_metrics: bool = False
    counted: CountedWindows | None = None   # a loss over counted items: the epoch's windows (item_windows)


class Loop:
    """Runs epochs of training, evaluation and prediction for one process."""

    def __init__(self, model, callbacks: CallbackList, fit: Fit, settings: TrainingSettings | None = None, rates=None,
                 first_steps: dict | None = None):
        """`fit`: the fit's own object (its strategy's `setup` made it), or outside fit the Model's objects."""
        self.model, self.strategy, self.callbacks, self.training = model, fit.strategy, callbacks, fit
        self.net, self.optimizer, self.scheduler = fit.net, fit.optimizer, fit.scheduler
        self.precision: Precision = model.running.precision
        self.metrics: MetricSet = model.metrics
        self.settings = settings or TrainingSettings()
        self.rates = rates   # each step's LR scale (`StepRates`): the fit's scale and warmup; None outside fit
        # the FirstStep of a batch source (easyfit.training.first_batch) runs its first batch, with the checks, in
        # place of a plain step; it is dropped once that step ran
        self.first_steps: dict = dict(first_steps or {})
        self.loss_fn = model.loss_fn
        self.batches_checked = False
        self.train_batches = None
        self.optimizer_steps = 0
        self.steps: ModelSteps = model.compiled_steps   # each role's forward and loss: eager, or compiled (compile=)
        # set when `fit` starts: what runs the epoch's steps from the first it can take on (None: this loop's step),
        # else the optimizer step compiled on its own (None: the strategy's)
        self.runner: StepRunner | None = None
        self.compiled_optimizer_step = None
        self.items: ItemSteps | None = None   # a loss over counted items: its steps (easyfit.training.item_windows)

    # --- training -------------------------------------------------------------------
    def fit(self, train_batches, val_batches, epochs: int, initial_epoch: int = 0,
            validation_freq: int = 1) -> None:
        callbacks, model = self.callbacks, self.model
        self.train_batches = train_batches
        self.items = self._item_steps(train_batches)
        self.runner = self.steps.runner(self)
        if self.runner is None:
            self.step_in_parts()
        callbacks.call("on_train_begin", None)
        for epoch in range(initial_epoch, epochs):
            train_batches.set_epoch(epoch)
            begin_logs: dict[str, float] = {}   # values a callback records for this epoch (e.g. "learning_rate")
            callbacks.call("on_epoch_begin", epoch, begin_logs)
            logs = self.train_epoch(train_batches, epoch)
            if val_batches is not None and (epoch + 1) % validation_freq == 0:
                logs.update({f"val_{key}": value for key, value in self.evaluate(val_batches).items()})
            logs.update(begin_logs)
            self._step_scheduler_per_epoch(logs, "val_loss" if val_batches is not None else "loss")
            model.completed_epochs = epoch + 1
            model.position.end()
            callbacks.call("on_epoch_end", epoch, logs)
            if self._agreed_to_stop():
                break
        callbacks.call("on_train_end", None)

    def train_epoch(self, batches, epoch: int = 0) -> dict[str, float]:
        net, strategy, callbacks, model = self.net, self.strategy, self.callbacks, self.model
        accumulate = self.settings.gradient_accumulation_steps
        tracker = self._loss_tracker()
        num_batches = epoch_length(batches)   # fewer than len() where step-limited data runs out
        # a batch hook may ask to stop on one rank only: then every rank agrees after each step (one tiny reduce);
        # with data of unknown length a rank that stops early simply runs out of data (see `uneven_inputs`)
        uneven = num_batches is None and strategy.world_size > 1
        self._check_even_batches(num_batches)
        # a backend that accumulates divides the loss itself (divisor 1)
        epoch_run = TrainingEpoch(batches, tracker, num_batches, accumulate,
                                  1 if strategy.capabilities.handles_accumulation else accumulate,
                                  callbacks.wants("on_train_batch_begin"), callbacks.wants("on_train_batch_end"),
                                  strategy.world_size > 1 and not uneven and callbacks.may_stop_mid_epoch(),
                                  self.steps.step("train"))
        epoch_run.plain = step_function(epoch_run.forward_loss, self.loss_fn, None)
        epoch_run.has_metrics = bool(self.metrics)
        remaining, first = model.position.begin(batches, tracker, accumulate, epoch)   # first > 0: mid-epoch resume
        net.train()
        if not first:   # a resumed epoch's metrics hold the state of its batches before the checkpoint
            self.metrics.reset()
        step = first - 1
        with self.training.uneven_inputs() if uneven else SYNC:
            feed = iter(strategy.feed(remaining))
            if self.items is not None:
                epoch_run.counted = self.items.epoch(strategy, accumulate, num_batches, across_ranks=not uneven)
                feed = epoch_run.counted.batches(feed, first)
            for step, batch in enumerate(feed, first):
                if self._runner_takes_over(step, batches):   # the rest of the epoch, run another way
                    step = self.runner.train(itertools.chain([batch], feed), step, epoch_run)
                    break
                if self.train_batch(step, batch, epoch_run):
                    break
        if tracker.empty and not first:   # first: a resumed epoch may train none
            raise ValueError("the training data yielded no batches; pass at least one sample")
        if accumulate > 1 and (step + 1) % accumulate and self._ran_out(step + 1, num_batches):
            self._optimizer_step()   # the short window the data ended with (a window end it could not foresee)
        return self._epoch_logs(tracker)

    def train_batch(self, step: int, batch, epoch_run: TrainingEpoch) -> bool:
        """The one training step: the batch, its forward and loss and backward (the strategy's `training_step`),
        then at the end of an accumulation window clipping and the optimizer step (`_optimizer_step`), then the
        logs and hooks; the forward with the loss and the optimizer step may be compiled parts (compile=). Whether
        to stop."""
        fit, precision = self.training, self.precision
        accumulate = epoch_run.accumulate
        self.begin_batch(step, epoch_run)
        inputs, target = split_batch(precision.convert_input(batch))
        boundary = accumulate == 1 or (step + 1) % accumulate == 0 or step + 1 == epoch_run.num_batches
        with (SYNC if boundary else fit.no_sync()):   # also tells an accumulating backend
            if accumulate == 1 or step % accumulate == 0:   # a new accumulation window: fresh gradients
                fit.zero_grad()
            step_fn, divisor, items = self._forward_and_loss(epoch_run)
            output, target, loss = fit.training_step(inputs, target, step_fn, precision, divisor)
            self.first_steps.pop(epoch_run.batches, None)   # a first batch's checks ran in its real step
        if boundary:
            self._optimizer_step()
        elif epoch_run.divisor == 1 and accumulate > 1:   # the backend accumulates: it sees every micro-step
            fit.optimizer_step(precision)
        loss = loss.detach()
        size = self.track(epoch_run, loss, inputs, target, output, items)
        return self.end_batch(step, epoch_run, loss if items is None else CountedMean(loss, *items), size)

    def _forward_and_loss(self, epoch_run: TrainingEpoch) -> tuple[Callable, int, tuple | None]:
        """The step_fn of the next batch for `Strategy.training_step`, the divisor of its loss, and for a loss over
        counted items the batch's (items, scale): its items' losses summed, over the step's D (item_windows)."""
        first_step = self.first_steps.get(epoch_run.batches)
        items = None if epoch_run.counted is None else epoch_run.counted.next_count()
        if items is not None:
            return self.items.runner(epoch_run.forward_loss, first_step, True, items[0]), 1, items
        if first_step is None:
            return epoch_run.plain, epoch_run.divisor, None
        return step_function(epoch_run.forward_loss, self.loss_fn, first_step), epoch_run.divisor, None

    def _runner_takes_over(self, step: int, batches) -> bool:
        """Whether the fit's step runner runs the epoch from batch `step` on: it has one, the first batch's checks
        ran, and the runner is ready."""
        return self.runner is not None and batches not in self.first_steps and self.runner.ready(step)

    def begin_batch(self, step: int, epoch_run: TrainingEpoch) -> None:
        if epoch_run.batch_begin:
            self.callbacks.call("on_train_batch_begin", step, None)

    def track(self, epoch_run: TrainingEpoch, loss, inputs, target, output, items: tuple | None = None) -> int:
        """A trained batch in the epoch's logs: its loss (a counted batch's over its `items`) and the metrics on its
        output (None: this rank holds none, see training_step); the batch's size."""
        size = batch_length(target if target is not None else inputs)
        if items is None:
            epoch_run.tracker.add(loss, size)
        else:
            epoch_run.tracker.add_counted(loss, items[1], items[0])
        if epoch_run.has_metrics and output is not None:
            self.metrics.update(output, target)
        return size

    def end_batch(self, step: int, epoch_run: TrainingEpoch, loss, size: int) -> bool:
        """Batch `step` trained: the epoch's position and the batch-end hook; whether to stop."""
        self.model.position.batches_done = step + 1
        if epoch_run.batch_end:
            self.callbacks.call("on_train_batch_end", step, BatchLogs(epoch_run.tracker, loss, size))
        return self._agreed_to_stop() if epoch_run.agree_per_step else self.model.stop_training

    def _item_steps(self, batches) -> ItemSteps | None:
        """The steps of a loss over counted items (easyfit.training.item_windows); None where the loss is a per-batch
        mean, or the targets of in-memory data (under compile=, of the first batch read ahead) are not counted."""
        counting = item_counting(self.loss_fn, self.net) if self.strategy.capabilities.counts_items else None
        if counting is None:
            return None
        target = _known_target(batches)
        if target is None and self.steps.settings is not None:   # whether whole-step programs may run
            target = split_batch(peek_first_batch(batches) or ((),))[1]
        return None if target is not None and not counting.applies(target) else ItemSteps.cached(self, counting)

    def _loss_tracker(self) -> LossTracker:
        per_step = self.strategy.capabilities.sums_losses_per_step
        return LossTracker(1 if per_step else LossTracker.FOLD_EVERY, self.metrics)

    def _ran_out(self, trained: int, num_batches: int | None) -> bool:
        """Whether the epoch ended with its data after `trained` batches, not at a known length or a stop: data of
        unknown length, or step-limited data whose length is not known ahead."""
        return num_batches is None or (trained < num_batches and not self.model.stop_training)

    def _agreed_to_stop(self) -> bool:
        """Whether any rank asked to stop (`model.stop_training`); then every rank stops, at the same step."""
        model = self.model
        model.stop_training = self.strategy.any_rank(model.stop_training)
        return model.stop_training

    def _check_even_batches(self, num_batches: int | None) -> None:
        """Ranks with different numbers of batches would wait for each other in a step that never comes: compare
        the counts once (when known) and say what differs."""
        strategy = self.strategy
        if self.batches_checked or strategy.world_size == 1 or num_batches is None:
            return
        counts = [int(count) for count in strategy.all_gather(
            torch.tensor([num_batches], device=strategy.root_device))]
        self.batches_checked = True
        if len(set(counts)) > 1:
            per_rank = ", ".join(f"rank {rank}: {count}" for rank, count in enumerate(counts))
            raise ValueError(f"the ranks have different numbers of training batches per epoch ({per_rank}), so "
                             "they would wait for each other in a step that never comes. Pass the same data on "
                             "every rank (easyfit gives each rank its share), or give every rank's own data the "
                             "same length.")

    def _epoch_logs(self, tracker: LossTracker) -> dict[str, float]:
        """The epoch's loss and metrics over every process; each rank joins the same collectives, even one whose
        share of the data was empty."""
        strategy, metrics = self.strategy, self.metrics
        logs = Logs(loss=tracker.global_mean(strategy))   # "lr" still reads "learning_rate", for one release
        sync = strategy.world_size > 1
        if sync:
            metrics.share_task(strategy)
        logs.update(metrics.compute(strategy.metric_sync_fn() if sync else None))
        return logs

    def step_in_parts(self) -> None:
        """The steps from now on run part by part in `train_batch`: the optimizer step compiled on its own where
        compile= compiles it, else the strategy's."""
        self.compiled_optimizer_step = self.steps.optimizer_step(self.optimizer, self.precision, self.strategy)

    def _optimizer_step(self) -> None:
        settings = self.settings
        self.before_step()
        if settings.gradient_clip_val is not None and not self.strategy.capabilities.handles_clipping:
            self.training.clip_gradients(settings.gradient_clip_val, self.precision)
        if self.compiled_optimizer_step is not None:
            self.compiled_optimizer_step()
        else:
            self.training.optimizer_step(self.precision)
        self.after_step()

    def before_step(self) -> None:
        """The learning rates of the coming optimizer step: the groups' own, scaled (and ramped in the warmup)."""
        if self.rates is not None:
            self.rates.apply(self.optimizer_steps)

    def after_step(self) -> None:
        """The optimizer step counted, the groups' own LRs given back, and a per-step schedule stepped."""
        self.optimizer_steps += 1
        if self.rates is not None:
            self.rates.release()
        if self.scheduler is not None and self.settings.scheduler_interval == "step":
            self.scheduler.step()

    def _step_scheduler_per_epoch(self, logs: dict, plateau_key: str) -> None:
        """Step the scheduler; ReduceLROnPlateau always reads `plateau_key`, and waits out epochs without it
        (no validation that epoch with validation_freq > 1)."""
        if self.scheduler is None or self.settings.scheduler_interval != "epoch":
            return
        if isinstance(self.scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
            if plateau_key in logs:
                self.scheduler.step(logs[plateau_key])
        else:
            self.scheduler.step()

    # --- evaluation and prediction --------------------------------------------------
    @torch.no_grad()
    def evaluate(self, batches) -> dict[str, float]:
        """Loss and metrics over every sample exactly once, summed over all processes."""
        precision, callbacks = self.precision, self.callbacks
        metrics, forward_loss = self.metrics, self.steps.step("evaluate")
        batch_begin, batch_end = callbacks.wants("on_test_batch_begin"), callbacks.wants("on_test_batch_end")
        metrics.reset()
        tracker = self._loss_tracker()
        first_step, plain = self.first_steps.get(batches), step_function(forward_loss, self.loss_fn, None)
        items = self.items or self._item_steps(batches)
        callbacks.call("on_test_begin", None)   # before the module is made: a callback may swap the weights (EMA)
        net = self.training.module_for_eval()
        with eval_mode(net):
            for step, (batch, counted) in enumerate(self._eval_batches(batches)):
                if not counted:   # a sharded net: another rank still evaluates, and its forward needs this one
                    with precision.autocast():
                        call_net(net, split_batch(precision.convert_input(batch))[0])
                    continue
                if batch_begin:
                    callbacks.call("on_test_batch_begin", step, None)
                inputs, target = split_batch(precision.convert_input(batch))
                count = None if items is None else items.count(target)
                if count is not None:   # a counted batch: its items' losses summed
                    step_fn = items.runner(forward_loss, first_step, False, count)
                else:
                    step_fn = plain if first_step is None else step_function(forward_loss, self.loss_fn, first_step)
                output, target, loss = self.strategy.evaluation_step(net, inputs, target, step_fn, precision)
                if first_step is not None:   # the checks of the first batch ran in its real step
                    first_step = None
                    del self.first_steps[batches]
                size = batch_length(target)
                if count is None:
                    tracker.add(loss.detach(), size)
                else:
                    tracker.add_counted(loss.detach(), items.one, count)
                    loss = CountedMean(loss, count, items.one)
                if metrics and output is not None:
                    metrics.update(output, target)
                if batch_end:
                    callbacks.call("on_test_batch_end", step, BatchLogs(tracker, loss, size))
            logs = self._epoch_logs(tracker)
            callbacks.call("on_test_end", logs)
        return logs

    def _eval_batches(self, batches):
        """(batch, counted) pairs; a sharded net runs in step with the other ranks (see easyfit.training.lockstep)."""
        if not self.training.forward_in_lockstep():
            return ((batch, True) for batch in self.strategy.feed(batches))
        return in_lockstep(batches, self.strategy, lambda: peek_first_batch(self.train_batches))

    @torch.no_grad()
    def predict(self, batches) -> list:
        """This process's outputs, batch by batch, moved to the CPU."""
        precision, callbacks = self.precision, self.callbacks
        callbacks.call("on_predict_begin", None)   # before the module is made, as on_test_begin
        net = self.training.module_for_eval()
        outputs, to_inputs, forward = [], PredictInputs(net), self.steps.step("predict")
        first_step, plain = self.first_steps.get(batches), step_function(forward, None, None)
        with eval_mode(net):
            for step, batch in enumerate(self.strategy.feed(batches)):
                callbacks.call("on_predict_batch_begin", step, None)
                inputs = to_inputs(precision.convert_input(batch))
                step_fn = plain if first_step is None else step_function(forward, None, first_step)
                output = self.strategy.evaluation_step(net, inputs, None, step_fn, precision)[0]
                if first_step is not None:
                    first_step = None
                    del self.first_steps[batches]
                output = prediction(output)   # a ModelOutput's logits (easyfit.parts.outputs)
                if output is not None:   # None: this rank holds no outputs (see evaluation_step)
                    outputs.append(on_cpu(output))
                callbacks.call("on_predict_batch_end", step, {"outputs": output})
            callbacks.call("on_predict_end", None)
        return outputs


def _known_target(batches):
    """The targets of in-memory data; None where they are known only as the batches are read."""
    data = batch_source(batches)
    if not isinstance(data, TensorBatches) or data.inputs_only or len(data.tensors) < 2:
        return None
    return data.tensors[-2 if data.weighted else -1]


@contextlib.contextmanager
def eval_mode(net: torch.nn.Module):
    """The net in eval mode inside the block; its previous mode back after it, even when the block raised."""
    was_training = net.training
    net.eval()
    try:
        yield
    finally:
        net.train(was_training)
