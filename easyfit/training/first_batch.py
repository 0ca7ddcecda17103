"""The first batch of every call, run by the loop as its real first step (`FirstStep`): what would fail there (data
the net cannot take, targets that do not suit the loss or the metrics, a net returning a tuple to a loss that takes
one tensor, a loss that is not a scalar, a BatchNorm batch of one) is explained in words before the first optimizer
step, and no user code runs an extra time. The one exception is fit's validation data: its first batch runs once
through the net before training (eval mode, no gradients, on a copy of the RNG state; the loss is not called), so
that validation data the net cannot take is reported before an epoch of training rather than after it.

In-memory data is brought once to what the net and the loss take (easyfit.data.conform) as its first step
runs; other mismatches in the user's own batches are explained, not converted.
"""
from __future__ import annotations

import torch
from torch import nn

from easyfit.data.batches import TensorBatches, batch_source, peek_first_batch
from easyfit.data.conform import class_labels, class_targets, conform, data_dtype, integers_to_floats
from easyfit.data.contents import call_net, move_to_device, split_batch
from easyfit.data.explain import (
    BATCH_NORMS,
    check_batch_of_one,
    check_output_kind,
    check_scalar_loss,
    explain,
)
from easyfit.data.source import BatchSource
from easyfit.parts.losses import check_class_range, check_targets
from easyfit.parts.outputs import prediction
from easyfit.saving.export import recorded_example
from easyfit.training.loop import eval_mode
from easyfit.utils.tensors import map_tensors


def prepare_fit_data(model, fit, train: BatchSource, val: BatchSource | None) -> dict[BatchSource, FirstStep]:
    """Before the first epoch: in-memory data conformed to the net, and the validation data's first batch checked
    (the one forward pass run ahead of training); the first steps of the training and validation batches, by
    batches, for the loop (`Loop.first_steps`)."""
    eval_net = fit.module_for_eval()   # a sharding strategy gathers a copy per call: one for all three
    first_steps = {train: prepare(model, eval_net, train, "the training data", training=True)}
    if val is not None:
        first_steps[val] = prepare(model, eval_net, val, "the validation data")
        _check_validation_batch(model, eval_net, val)
    return first_steps


def prepare(model, eval_net: nn.Module, batches: BatchSource, source: str, training: bool = False,
            targets: bool = True) -> FirstStep:
    """Conform in-memory data to the net evaluation runs (the fit's `module_for_eval`); the `FirstStep` the loop
    runs as the first batch of `batches`."""
    step = FirstStep(model, batches, source, training)
    if isinstance(step.data, TensorBatches):
        conform(step.data, model.loss_fn if targets else None, data_dtype(eval_net, step.precision))
    return step


class FirstStep:
    """Runs the first batch as the loop would, with the checks; the loop then drops it (`Loop.first_steps`).
    `data`: the batch source under the batches' step limits and weights; `precision`: the running call's."""

    def __init__(self, model, batches: BatchSource, source: str, training: bool):
        self.model, self.batches, self.source, self.training = model, batches, source, training
        self.data, self.precision = batch_source(batches), model.running.precision

    def forward(self, net: nn.Module, inputs):
        """The net's output on the first batch; in-memory integer inputs become floats when the net raised on them."""
        self.model._input_example = recorded_example(inputs)   # what model.export traces with
        norms: list = []
        hooks = [module.register_forward_pre_hook(lambda m, args, name=name: norms.append((name, m, args[0].shape)))
                 for name, module in net.named_modules() if self.training and isinstance(module, BATCH_NORMS)]
        try:
            output = self._forward(net, inputs)
        except Exception:
            if self.training:   # a first batch of one into BatchNorm raises in torch: say why and what to do
                check_batch_of_one(self.data, norms, self.source)
            raise
        finally:
            for hook in hooks:
                hook.remove()
        if self.training:
            check_batch_of_one(self.data, norms, self.source)
        return output

    def _forward(self, net: nn.Module, inputs):
        try:
            return call_net(net, inputs)
        except (RuntimeError, TypeError) as error:
            dtype = data_dtype(net, self.precision)
            if not (isinstance(self.data, TensorBatches) and integers_to_floats(self.data, dtype)):
                raise explain(error, net, inputs, self.source) from error
            first = error
        floats = map_tensors(lambda t: t if t.is_floating_point() else t.to(dtype), inputs)
        self.model._input_example = recorded_example(floats)
        try:
            return call_net(net, floats)
        except (RuntimeError, TypeError):   # not a net of float inputs either: the integers' error is the one
            raise explain(first, net, inputs, self.source) from first

    def forward_and_loss(self, net: nn.Module, inputs, target, loss_fn) -> tuple:
        """(output, target, loss) of the first training or evaluation batch, checked."""
        output = self.forward(net, inputs)
        target = self.check_target(output, target, loss_fn)
        loss = loss_fn(output, target)
        check_scalar_loss(loss)
        return output, target, loss

    def check_target(self, output, target, loss_fn):
        """The target as the loss takes it ((N, 1) labels squeezed, integer labels int64), checked against the
        output, the loss and the metrics."""
        if target is None:
            raise ValueError(f"{self.source} has no targets: pass y to fit, or data whose batches are (x, y) pairs "
                             "or dicts with a 'y' / 'target' / 'label' / 'labels' key")
        metrics = self.model.metrics
        check_output_kind(output, loss_fn, metrics)
        output = prediction(output)   # a ModelOutput's logits (easyfit.parts.outputs)
        if isinstance(output, torch.Tensor) and isinstance(target, torch.Tensor):
            target = class_targets(self.data, output, target, loss_fn)
            check_targets(loss_fn, output, target)
            labels = class_labels(self.data, loss_fn, target)
            if labels is not None and output.dim() >= 2:
                check_class_range(loss_fn, output.shape[1], labels)   # every label
            if metrics.pending:
                metrics.build(output.detach(), target)
        return target



def _check_validation_batch(model, net: nn.Module, val) -> None:
    """The validation data's first batch (when it can be read ahead) through `net`, the net evaluation runs: targets
    present, inputs the net takes, targets the loss takes. One forward pass in eval mode, without gradients, on a
    copy of the RNG state."""
    data = batch_source(val)
    batch = peek_first_batch(data)
    if batch is None:
        return
    batch = move_to_device(batch, model.strategy.root_device)   # where the backend's loader would put it
    inputs, target = split_batch(batch[:-1] if data.weighted else batch)   # less the weights
    if target is None:
        raise ValueError("validation_data has no targets: its batches hold inputs only, so there is no validation "
                         "loss to compute. Pass validation_data=(x_val, y_val), or a Dataset / DataLoader whose "
                         "batches are (x, y) pairs.")
    step = FirstStep(model, val, "the validation data", training=False)
    precision = step.precision
    cuda = sorted({p.device.index or 0 for p in net.parameters() if p.device.type == "cuda"})
    with torch.random.fork_rng(devices=cuda), torch.no_grad(), eval_mode(net), precision.autocast():
        output = step.forward(net, precision.convert_input(inputs))
    if output is None:   # this rank holds no outputs (a pipeline's earlier stage): the last stage checks them
        return
    check_output_kind(output, model.loss_fn, model.metrics)
    output = prediction(output)
    if isinstance(output, torch.Tensor) and isinstance(target, torch.Tensor):
        check_targets(model.loss_fn, output, class_targets(data, output, target, model.loss_fn))
