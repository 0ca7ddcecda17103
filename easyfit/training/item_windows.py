"""Steps of a loss over counted items (easyfit.parts.item_counts): one optimizer step's gradient is that of the sum of
every counted item's loss over the step's micro-batches and data-parallel ranks, divided by the step's items.

The loop reads an accumulation window's batches ahead before its first backward and counts their items from the
targets (no forward needed); across the ranks that is one scalar all-reduce per optimizer step, on
`strategy.root_device`. Each micro-batch then backpropagates `sum of its items' losses / D`, where
`D = items of the step / (data-parallel ranks x the accumulation a backend divides by itself)`: the backends
average gradients over the ranks (DDP divides by the world size) and DeepSpeed divides by its accumulation steps,
so the gradient at the optimizer step (and at clipping) is the combined batch's mean. `D` is one tensor filled in
place, an input of a compiled step rather than a constant. The epoch's loss is the sum over its items over their
number."""
from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator
from typing import Callable

import torch

from easyfit.data.contents import split_batch
from easyfit.parts.item_counts import ItemCounting


class ItemSteps:
    """A fit's (or an evaluate call's) steps over counted items: the divided losses, built once so that a compiled
    step sees the same objects every epoch."""

    def __init__(self, counting: ItemCounting, loss_fn: Callable, device: torch.device):
        self.counting, self.loss_fn = counting, loss_fn
        self.denominator = torch.ones((), device=device)   # the training step's D, filled per window
        self.one = torch.ones((), device=device)   # evaluation sums the items' losses
        self.batch_items = torch.zeros((), device=device)   # the batch's items, for a counting that reads them
        self.losses = {True: counting.divided_loss(loss_fn, self.denominator, self.batch_items),
                       False: counting.divided_loss(loss_fn, self.one, self.batch_items)}
        self.step_fns: dict = {}   # (forward_loss, training) -> the step of a batch after the first

    @classmethod
    def cached(cls, loop, counting: ItemCounting) -> ItemSteps:
        """The loop's item steps, kept with the Model's compiled steps: a compiled step sees the same loss objects
        in every call."""
        device = loop.strategy.root_device
        key = ("items", id(loop.loss_fn), type(counting), device)
        if key not in loop.steps.cache:
            loop.steps.cache[key] = cls(counting, loop.loss_fn, device)
        return loop.steps.cache[key]

    def runner(self, forward_loss: Callable, first_step, training: bool, items) -> Callable:
        """step_fn(net, inputs, target) -> (output, target, the batch's item losses summed over D (training) or 1)
        for a batch of `items` items."""
        denominator = self.denominator if training else self.one
        counting = self.counting
        if counting.uses_batch_items and isinstance(items, torch.Tensor):
            self.batch_items.copy_(items)
        elif counting.uses_batch_items:
            self.batch_items.fill_(items)
        if first_step is None and (forward_loss, training) in self.step_fns:
            return self.step_fns[forward_loss, training]
        if first_step is not None:
            def first(net, inputs, target):
                output, target, loss = first_step.forward_and_loss(net, counting.inputs(inputs, denominator), target,
                                                                   self.loss_fn)
                loss = counting.divided(self.loss_fn, denominator, self.batch_items, output, target, loss)
                return output, target, loss
            return first
        divided = self.losses[training]

        def step_fn(net, inputs, target):
            output, loss = forward_loss(net, divided, counting.inputs(inputs, denominator), target)
            return output, target, loss
        self.step_fns[forward_loss, training] = step_fn
        return step_fn

    def count(self, target) -> torch.Tensor | int | None:
        """The items of an evaluation batch; None: it is not counted (a per-batch mean)."""
        return self.counting.count(target) if self.counting.applies(target) else None

    def epoch(self, strategy, accumulate: int, num_batches: int | None, across_ranks: bool) -> CountedWindows:
        return CountedWindows(self, strategy, accumulate, num_batches, across_ranks)


class CountedWindows:
    """One training epoch's accumulation windows, each counted before its first batch trains."""

    def __init__(self, steps: ItemSteps, strategy, accumulate: int, num_batches: int | None, across_ranks: bool):
        self.steps, self.strategy, self.accumulate, self.num_batches = steps, strategy, accumulate, num_batches
        self.across_ranks = across_ranks and strategy.world_size > 1
        ranks = strategy.data_parallel_size if self.across_ranks else 1
        self.shares = ranks * (accumulate if strategy.capabilities.handles_accumulation else 1)
        self.counts: deque = deque()

    @property
    def denominator(self) -> torch.Tensor:
        return self.steps.denominator

    def batches(self, feed: Iterable, first: int) -> Iterator:
        """The batches of `feed` (the first one's index: `first`), each window read and counted ahead."""
        feed, done = iter(feed), first
        while True:
            window = []
            for batch in feed:
                window.append(batch)
                done += 1
                if done % self.accumulate == 0 or done == self.num_batches:
                    break
            if not window:
                return
            targets = [split_batch(batch)[1] for batch in window]
            if self.steps.counting.applies(targets[0]):
                counts = [self.steps.counting.count(target) for target in targets]
                self._divide_by(sum(counts[1:], counts[0]))
                self.counts.extend((count, self.scale) for count in counts)
            else:
                self.counts.extend([None] * len(window))
            yield from window

    def next_count(self) -> tuple | None:
        """The items of the batch about to train and its window's D (None: it trains as a per-batch mean)."""
        return self.counts.popleft()

    def _divide_by(self, items: torch.Tensor) -> None:
        """D for the window: its items over every data-parallel rank (ranks that share a batch, a tensor-parallel
        group, count it once), per share of the gradient's average; at least 1 (a window of padding only)."""
        strategy = self.strategy
        if self.across_ranks:
            items = strategy.reduce(torch.as_tensor(items, device=strategy.root_device), "sum")
            if strategy.data_parallel_size != strategy.world_size:
                items = items * (strategy.data_parallel_size / strategy.world_size)
        if not isinstance(items, torch.Tensor):   # counted on the host (see count_items)
            self.scale = max(items, 1) / self.shares
            self.denominator.fill_(self.scale)
            return
        denominator = self.denominator.copy_(items).clamp_(min=1)   # in place: no Python number made a tensor
        if self.shares != 1:
            denominator.div_(self.shares)
        self.scale = denominator.clone()   # this window's D, for its losses in the epoch's sum


class CountedMean:
    """A counted batch's mean loss over its items (0 without items), from its loss over `scale`, for the batch logs:
    worked out only when a callback reads it (`float`)."""

    def __init__(self, loss: torch.Tensor, items, scale):
        self.loss, self.items, self.scale = loss, items, scale

    def __float__(self) -> float:
        return float(self.loss) * float(self.scale) / max(float(self.items), 1.0)
