"""One rank's stages of a pipelined nn.Sequential and torch's schedules (torch.distributed.pipelining) that run them.

A batch of B samples runs as `microbatches` equal micro-batches; when B does not divide, the rest runs as one more
micro-batch in a second schedule step, so no sample is dropped or repeated. Each micro-batch's loss is the user's
(mean) loss scaled by its share of the batch, and the engine's own scaling is off: the gradients are exactly those
of the whole batch. torch's stages learn their tensor shapes from static metadata that the ranks exchange once per
micro-batch shape (a forward on zeros, in eval mode, with the RNG untouched), so nothing runs in training mode twice.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

from easyfit.data.explain import explain
from easyfit.distributed.strategy_parts.pipeline_split import CheckpointedStage

#: the "net" the loop's forward-and-loss runs on a micro-batch's outputs: the loss is all that is left to compute
IDENTITY = nn.Identity()


@dataclass(frozen=True)
class Layout:
    """Where this rank sits in the (replicas x pipeline ranks) mesh; global rank = replica * pipeline_size + pp_rank.
    With the interleaved schedule each pipeline rank holds `chunks` stages: pp_rank, pp_rank + size, ..."""
    pipeline_size: int
    replicas: int
    pp_rank: int
    replica: int
    chunks: int = 1

    @property
    def num_stages(self) -> int:
        return self.pipeline_size * self.chunks

    @property
    def local_stages(self) -> list[int]:
        return [self.pp_rank + chunk * self.pipeline_size for chunk in range(self.chunks)]

    def global_rank(self, pp_rank: int, replica: int | None = None) -> int:
        return (self.replica if replica is None else replica) * self.pipeline_size + pp_rank

    @property
    def last_rank(self) -> int:
        """The global rank of this pipeline's last stage (the one that holds the outputs)."""
        return self.global_rank(self.pipeline_size - 1)

    @property
    def holds_first(self) -> bool:
        return self.pp_rank == 0

    @property
    def holds_last(self) -> bool:
        return self.pp_rank == self.pipeline_size - 1


def parts(size: int, microbatches: int) -> list[tuple[int, int, int]]:
    """(start, samples, micro-batches) of the schedule steps one batch of `size` samples takes."""
    full = size // microbatches
    steps = [(0, full * microbatches, microbatches)] if full else []
    if size % microbatches:
        steps.append((full * microbatches, size % microbatches, 1))
    return steps


class PipelinedNet(nn.Module):
    """This rank's stages; `forward` runs a forward-only pipeline step (the output on the last stage, None on the
    others), `train_batch` forward, loss and backward of a whole batch."""

    def __init__(self, stages: list[nn.Sequential], layout: Layout, group, device: torch.device, schedule: str,
                 microbatches: int, checkpoint: str):
        super().__init__()
        self.stages = nn.ModuleList(CheckpointedStage(layers, checkpoint) for layers in stages)
        self.layout, self.group, self.device = layout, group, device
        self.schedule_name, self.microbatches = schedule, microbatches
        self.plans: dict[tuple, object] = {}
        self.step_fn: Callable | None = None   # the forward and loss of the batch being trained (see _microbatch_loss)
        self.batch_size, self.recorded, self.targets = 1, [], []

    def layers(self) -> list[nn.Sequential]:
        return [stage.layers for stage in self.stages]

    # --- running ----------------------------------------------------------------------
    def forward(self, inputs):
        """The net's output for `inputs` on the last stage's rank, None on the others (every rank of the pipeline
        calls it with the same batch)."""
        return self._run(inputs, None, training=False)

    def train_batch(self, inputs, target, step_fn: Callable, divisor: int = 1):
        """Forward, loss and backward of one batch; gradients accumulate into .grad. `step_fn` is the loop's forward and
        loss (see Strategy.training_step), given the outputs of each micro-batch (IDENTITY as the net). Returns
        (output, target as the loss took it, mean loss) on the last stage's rank, (None, target, None) elsewhere."""
        self.step_fn, self.batch_size, self.recorded, self.targets = step_fn, len(target) * divisor, [], []
        output = self._run(inputs, target, training=True)
        if not self.layout.holds_last:
            return None, target, None
        return output, torch.cat(self.targets), torch.stack(self.recorded).sum() * divisor / self.batch_size

    def _run(self, inputs, target, training: bool):
        if not isinstance(inputs, torch.Tensor):
            raise TypeError(f"strategy='pipeline' feeds one input tensor to the first stage, got "
                            f"{type(inputs).__name__}; give the nn.Sequential one input per sample")
        outputs = []
        for start, count, microbatches in parts(len(inputs), self.microbatches):
            chunk = inputs[start:start + count]
            schedule = self._plan(training, microbatches, chunk)
            for stage in self.stages:
                stage.start_step(microbatches)
            args = (chunk,) if self.layout.holds_first else ()
            targets = {"target": target[start:start + count]} if training and self.layout.holds_last else {}
            outputs.append(schedule.step(*args, **targets))
        return torch.cat(outputs) if self.layout.holds_last else None

    def _microbatch_loss(self, output, target):
        """The user's loss of one micro-batch, weighted by its share of the batch (so the gradients add up to the
        whole batch's); its sample-weighted value is kept for the batch's loss."""
        _, target, loss = self.step_fn(IDENTITY, output, target)
        self.targets.append(target)
        self.recorded.append(loss.detach().double() * len(target))
        return loss * (len(target) / self.batch_size)

    # --- schedules, one per micro-batch shape ----------------------------------------------
    def _plan(self, training: bool, microbatches: int, chunk: torch.Tensor):
        device = self.device.type   # under autocast the stages pass on activations of another dtype
        autocast = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None
        key = (training, microbatches, tuple(chunk.shape), chunk.dtype, autocast)
        if key not in self.plans:
            self.plans[key] = self._build(training, microbatches, chunk[:len(chunk) // microbatches])
        return self.plans[key]

    def _build(self, training: bool, microbatches: int, example: torch.Tensor):
        metas = self._stage_metas(example)
        layout = self.layout
        stages = [PipelineStage(stage, index, layout.num_stages, self.device, input_args=_meta_tensor(metas[index]),
                                output_args=_meta_tensor(metas[index + 1]), group=self.group)
                  for index, stage in zip(layout.local_stages, self.stages)]
        loss_fn = self._microbatch_loss if training else None
        options = {"loss_fn": loss_fn, "scale_grads": False}
        if layout.chunks > 1:
            return ScheduleInterleaved1F1B(stages, microbatches, **options)
        use_1f1b = self.schedule_name == "1f1b" and microbatches >= layout.num_stages
        return (Schedule1F1B if use_1f1b else ScheduleGPipe)(stages[0], microbatches, **options)

    def _stage_metas(self, example: torch.Tensor) -> list[tuple[tuple, torch.dtype, bool]]:
        """(shape, dtype, requires grad) of each stage's input and of the last one's output, for a micro-batch like
        `example`: each stage's rank runs it on zeros, in eval mode without gradients, and tells the others."""
        metas = [(tuple(example.shape), example.dtype, False)]
        by_index = dict(zip(self.layout.local_stages, self.stages))
        for index in range(self.layout.num_stages):
            owner = self.layout.global_rank(index % self.layout.pipeline_size)
            holder = [None]
            if index in by_index:
                holder[0] = _output_meta(by_index[index].layers, metas[-1], self.device, first=index == 0)
            if self.layout.pipeline_size > 1:
                dist.broadcast_object_list(holder, src=owner, group=self.group)
            metas.append(holder[0])
        return metas


def _output_meta(layers: nn.Sequential, meta, device: torch.device, first: bool):
    """The (shape, dtype, requires grad) of the layers' output; data the first stage cannot take is explained."""
    shape, dtype, requires_grad = meta
    example = torch.zeros(shape, dtype=dtype, device=device)
    was_training = layers.training
    layers.eval()
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            output = layers(example)
    except (RuntimeError, TypeError) as error:
        raise (explain(error, layers, example, "the data") if first else error) from error
    finally:
        layers.train(was_training)
    if not isinstance(output, torch.Tensor):
        raise TypeError(f"a pipeline stage passes one tensor to the next, but layers {list(layers._modules)} "
                        f"return {type(output).__name__}")
    requires_grad = requires_grad or any(p.requires_grad for p in layers.parameters())
    return tuple(output.shape), output.dtype, requires_grad and output.is_floating_point()


def _meta_tensor(meta) -> torch.Tensor:
    shape, dtype, requires_grad = meta
    return torch.empty(shape, dtype=dtype, device="meta").requires_grad_(requires_grad)
