"""The first batch of every call, run by the loop as its real first step (`FirstStep`): what would fail there (data
the net cannot take, targets that do not suit the loss or the metrics, a net returning a tuple to a loss that takes
one tensor, a loss that is not a scalar, a BatchNorm batch of one) is explained in words before the first optimizer
step, and no user code runs an extra time. The one exception is fit's validation data: its first batch runs once
through the net before training (eval mode, no gradients, on a copy of the RNG state; the loss is not called), so
that validation data the net cannot take is reported before an epoch of training rather than after it.

In-memory data (arrays, tensors, DataFrames) is also brought once to what the net takes, as Keras does:
- floating inputs and targets become the net's float dtype (float16 or float64 data for a float32 net; float64 under
  precision="64");
- integer and bool inputs (uint8 images, 0/1 flags, counts) stay as they are when the net runs on them (an
  nn.Embedding takes integer indices); when the net raises on them, they become floats and the first step runs
  again (the forward that raised is the only repeated call). uint8 images are not rescaled: divide them by 255;
- integer class labels of shape (N, 1) for a class-index loss (cross_entropy, nll) become shape (N,).
Integer class labels of any integer dtype (int32, int16, uint8, bool, ...) become int64 for a class-index loss, and
bool labels become floats for a binary loss (bce, bce_with_logits), in memory and in the batches of a Dataset or
DataLoader (lossless). Other mismatches in the user's own batches are explained,
not converted.
"""
from __future__ import annotations

import torch
from torch import nn

from easyfit.data.batches import TensorBatches, batch_source, peek_first_batch
from easyfit.data.contents import call_net, move_to_device, split_batch
from easyfit.data.explain import (
    BATCH_NORMS,
    check_batch_of_one,
    check_output_kind,
    check_scalar_loss,
    explain,
    float_dtype,
)
from easyfit.data.source import BatchSource
from easyfit.parts.losses import BINARY_LOSSES, CLASS_INDEX_LOSSES, check_class_range, check_targets
from easyfit.parts.outputs import prediction
from easyfit.saving.export import recorded_example
from easyfit.training.loop import eval_mode
from easyfit.utils.tensors import map_tensors


def prepare_fit_data(model, net: nn.Module, train: BatchSource,
                     val: BatchSource | None) -> dict[BatchSource, FirstStep]:
    """Before the first epoch: in-memory data conformed to the net, and the validation data's first batch checked
    (the one forward pass run ahead of training); the first steps of the training and validation batches, by
    batches, for the loop (`Loop.first_steps`)."""
    eval_net = model.strategy.module_for_eval(net)   # a sharding strategy gathers a copy per call: one for all three
    first_steps = {train: prepare(model, eval_net, train, "the training data", training=True)}
    if val is not None:
        first_steps[val] = prepare(model, eval_net, val, "the validation data")
        _check_validation_batch(model, eval_net, val)
    return first_steps


def prepare(model, eval_net: nn.Module, batches: BatchSource, source: str, training: bool = False,
            targets: bool = True) -> FirstStep:
    """Conform in-memory data to the net evaluation runs (`strategy.module_for_eval`'s); the `FirstStep` the loop
    runs as the first batch of `batches`."""
    precision = model.precision
    data = batch_source(batches)
    if isinstance(data, TensorBatches):
        _conform_floats(data, _data_dtype(eval_net, precision))
        if targets:
            _conform_labels(data, model.loss_fn, _data_dtype(eval_net, precision))
    return FirstStep(model, batches, source, training)


class FirstStep:
    """Runs the first batch as the loop would, with the checks; the loop then drops it (`Loop.first_steps`)."""

    def __init__(self, model, batches: BatchSource, source: str, training: bool):
        self.model, self.batches, self.source, self.training = model, batches, source, training

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
                check_batch_of_one(batch_source(self.batches), norms, self.source)
            raise
        finally:
            for hook in hooks:
                hook.remove()
        if self.training:
            check_batch_of_one(batch_source(self.batches), norms, self.source)
        return output

    def _forward(self, net: nn.Module, inputs):
        data, precision = batch_source(self.batches), self.model.precision
        try:
            return call_net(net, inputs)
        except (RuntimeError, TypeError) as error:
            dtype = _data_dtype(net, precision)
            if not (isinstance(data, TensorBatches) and _integers_to_floats(data, dtype)):
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
            target = self.class_targets(output, target, loss_fn)
            check_targets(loss_fn, output, target)
            data = batch_source(self.batches)
            if isinstance(data, TensorBatches) and _is_class_index(loss_fn, target) and output.dim() >= 2:
                check_class_range(loss_fn, output.shape[1], data.tensors[_target_index(data)])   # every label
            if metrics.pending:
                metrics.build(output.detach(), target)
        return target

    def class_targets(self, output: torch.Tensor, target: torch.Tensor, loss_fn) -> torch.Tensor:
        data = batch_source(self.batches)
        if target.dtype == torch.bool and isinstance(loss_fn, BINARY_LOSSES):   # 0/1 flags as the loss's floats
            data.target_dtype = output.dtype if output.is_floating_point() else torch.float32
            return target.to(data.target_dtype)
        if not _is_class_index(loss_fn, target):
            return target
        if output.dim() == 2 and target.shape[1:] == (1,) and isinstance(data, TensorBatches):
            tensors = list(data.tensors)   # (N, 1) in-memory labels: squeezed, as Keras does
            tensors[_target_index(data)] = tensors[_target_index(data)].view(-1)
            data.tensors = tuple(tensors)
            target = target.view(-1)
        if target.dtype != torch.int64:
            data.target_dtype = torch.int64   # the batches of a loader from now on; in-memory data is int64 already
            target = target.long()
        return target


def _is_class_index(loss_fn, target: torch.Tensor) -> bool:
    return isinstance(loss_fn, CLASS_INDEX_LOSSES) and not target.is_floating_point() and not target.is_complex()


def _target_index(batches: TensorBatches) -> int:
    """Where the target lies among in-memory tensors: last, or before the sample weights."""
    return -2 if batches.weighted else -1


def _conform_labels(batches: TensorBatches, loss_fn, float_dtype: torch.dtype) -> None:
    """In-memory labels as the loss takes them: integer or bool class indices as int64 for a class-index loss, bool
    flags as floats for a binary loss (0 / 1, lossless)."""
    tensors, index = list(batches.tensors), _target_index(batches)
    if batches.inputs_only or len(tensors) < 1 - index:   # inputs, the target (and weights)
        return
    target = tensors[index]
    if _is_class_index(loss_fn, target) and target.dtype != torch.int64:
        tensors[index] = target.long()
    elif isinstance(loss_fn, BINARY_LOSSES) and target.dtype == torch.bool:
        tensors[index] = target.to(float_dtype)
    batches.tensors = tuple(tensors)


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
    precision = model.precision
    step = FirstStep(model, val, "the validation data", training=False)
    cuda = sorted({p.device.index or 0 for p in net.parameters() if p.device.type == "cuda"})
    with torch.random.fork_rng(devices=cuda), torch.no_grad(), eval_mode(net), precision.autocast():
        output = step.forward(net, precision.convert_input(inputs))
    if output is None:   # this rank holds no outputs (a pipeline's earlier stage): the last stage checks them
        return
    check_output_kind(output, model.loss_fn, model.metrics)
    output = prediction(output)
    if isinstance(output, torch.Tensor) and isinstance(target, torch.Tensor):
        check_targets(model.loss_fn, output, step.class_targets(output, target, model.loss_fn))


# --- conforming in-memory data --------------------------------------------------------------
def _data_dtype(net: nn.Module, precision) -> torch.dtype:
    """The dtype in-memory float data is conformed to: the net's, unless the backend casts the inputs itself."""
    return torch.float32 if precision.casts_inputs else float_dtype(net)


def _conform_floats(batches: TensorBatches, dtype: torch.dtype) -> None:
    batches.tensors = tuple(t.to(dtype) if t.is_floating_point() else t for t in batches.tensors)


def _input_count(batches: TensorBatches) -> int:
    """How many of the tensors are the net's inputs (the last one is the target when there are several)."""
    if batches.inputs_only:
        return len(batches.tensors)
    return max(1, len(batches.tensors) + _target_index(batches))


def _integers_to_floats(batches: TensorBatches, dtype: torch.dtype) -> bool:
    """Turn integer and bool inputs into `dtype`; False when there were none."""
    count, tensors = _input_count(batches), batches.tensors
    if all(t.is_floating_point() or t.is_complex() for t in tensors[:count]):
        return False
    batches.tensors = tuple(t.to(dtype) if i < count and not t.is_floating_point() else t
                            for i, t in enumerate(tensors))
    return True
