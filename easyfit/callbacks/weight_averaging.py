"""Weight averaging on torch.optim.swa_utils: `EMA` (an exponential moving average of the weights after optimizer
steps) and `SWA` (the equal average of the weights at the end of each epoch from `start_epoch` on, under SWALR).

Validation inside the fit runs the averaged weights (they are swapped in for the pass and out after it), and when
the fit ends the net holds them, so `evaluate`, `predict` and `save` use them too (Keras' `SwapEMAWeights`).
Checkpoints hold both sets: the training weights as the net's, the averages in this callback's state (after the
fit, the other way round), so a resumed fit continues both exactly.

Each rank averages the tensors its optimizer steps, which the strategy names (`Strategy.local_tensors`): the whole
weights under ddp (every rank the same), its shard under fsdp and DeepSpeed; they are asked for at each use, as a
backend may move the weights' storage after the fit starts (ddp_sharded's optimizer at its first step). Reading the
full averages for a checkpoint or for evaluation goes through the strategy's gather, as the hand-back at the end of
the fit does.
"""
from __future__ import annotations

import torch
from torch.optim.swa_utils import SWALR, get_ema_multi_avg_fn, get_swa_multi_avg_fn, update_bn

from easyfit.callbacks.base import Callback, random_state_kept
from easyfit.data.contents import split_batch
from easyfit.utils.checks import check_non_negative_int, check_positive_int, check_positive_number


class WeightAveraging(Callback):
    """The shared life of an average: made at the start of the fit (or taken from a resumed checkpoint), updated by
    `average()`, swapped in for validation, left in the net at the end. Subclasses decide when to `average()`."""

    may_stop_training = False

    def __init__(self, use_buffers: bool):
        self.use_buffers = use_buffers
        self.multi_avg_fn = None   # swa_utils' averaging function, while a fit runs (a closure: it never travels)
        self.running = False   # a fit runs: its net holds the training weights
        self.averaged: list[torch.Tensor] | None = None   # this rank's averages of its training tensors (`_local`)
        self.num_averaged = 0
        self.saved: dict | None = None        # a loaded state, until the fit it resumes starts
        self.training_weights: dict | None = None   # after the fit: the full training weights
        self.backup: list[torch.Tensor] | None = None   # the training tensors while validation runs the averages

    # --- the average -------------------------------------------------------------------
    def average(self) -> None:
        """Fold the current weights into the average (the first time: take them as they are)."""
        if self.num_averaged == 0:
            torch._foreach_copy_(self.averaged, self._local())
        else:
            self.multi_avg_fn(self.averaged, self._local(), self.num_averaged)
        self.num_averaged += 1

    def _local(self) -> list[torch.Tensor]:
        """This rank's training tensors, where they are now."""
        model = self.model
        return model._training.local_tensors(self.use_buffers)

    def _clone_net_state(self) -> dict:
        """The net's full state (a collective under a sharded strategy: every rank calls it), copied; whole tensors
        where the strategy keeps a sharded state (FSDP's state_dict_type="sharded"), which the strategy cuts into
        each rank's part again on load, on any number of processes."""
        return {key: _whole(value).detach().clone() for key, value in self.model.net_state().items()}

    def _full_average(self) -> dict:
        """The full averaged state, through the strategy's gather: the averages swapped in, read, swapped out."""
        self._swap_in()
        try:
            return self._clone_net_state()
        finally:
            self._swap_out()

    def _swap_in(self) -> None:
        local = self._local()
        self.backup = [tensor.clone() for tensor in local]
        torch._foreach_copy_(local, self.averaged)

    def _swap_out(self) -> None:
        torch._foreach_copy_(self._local(), self.backup)
        self.backup = None

    # --- the fit -----------------------------------------------------------------------
    def on_train_begin(self, logs=None):
        model, self.running = self.model, True
        self.multi_avg_fn = self._averaging_function()
        self.averaged = [tensor.clone() for tensor in self._local()]
        self.num_averaged, self.training_weights, self.backup, saved = 0, None, None, self.saved
        self.saved = None
        if saved is None:   # a fresh fit starts a new average
            return self._start({})
        training = saved.get("training") or self._clone_net_state()
        if saved.get("averaged") is not None:   # the strategy cuts the full averages into this rank's part
            model.load_net_state(saved["averaged"])
            torch._foreach_copy_(self.averaged, self._local())
            self.num_averaged = saved["num_averaged"]
        model.load_net_state(training)
        self._start(saved)

    def _averaging_function(self):
        raise NotImplementedError

    def _start(self, saved: dict) -> None:
        """A subclass takes its own part of a resumed state (empty for a fresh fit)."""

    def on_test_begin(self, logs=None):
        if self.running and self.num_averaged:   # validation inside the fit
            self._swap_in()

    def on_test_end(self, logs=None):
        if self.backup is not None:
            self._swap_out()

    def on_train_end(self, logs=None):
        if self.num_averaged:   # the net keeps the averages; the training weights stay in this callback's state
            self.training_weights = self._clone_net_state()
            torch._foreach_copy_(self._local(), self.averaged)
            with random_state_kept(self.model.strategy):   # the BatchNorm pass's Dropout and shuffling
                self._finish()
        self.averaged = self.multi_avg_fn = None
        self.running = False

    def _finish(self) -> None:
        """After the averages went into the net, before the strategy hands the weights back."""

    def set_params(self, params: dict) -> None:
        super().set_params(params)
        if "epochs" in params:   # a new fit: it averages afresh unless a resumed state is loaded next
            self.saved = self.training_weights = None

    # --- checkpoints -------------------------------------------------------------------
    def state_dict(self) -> dict:
        if self.running:   # inside the fit: the net holds the training weights
            averaged = self._full_average() if self.num_averaged else None
            return {"averaged": averaged, "num_averaged": self.num_averaged, **self._own_state()}
        if self.training_weights is not None:   # after it: the net holds the averages
            return {"averaged": self._clone_net_state(), "training": self.training_weights,
                    "num_averaged": self.num_averaged, **self._own_state()}
        return self.saved or {}

    def _own_state(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        self.saved = state


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    """A distributed tensor's whole value (a collective), any other tensor as it is."""
    if torch.distributed.is_available():
        from torch.distributed.tensor import DTensor
        if isinstance(tensor, DTensor):
            return tensor.full_tensor()
    return tensor


class EMA(WeightAveraging):
    """An exponential moving average of the weights: after every `every_n_steps`-th optimizer step,
    `average = decay * average + (1 - decay) * weights` (one fused `torch._foreach_lerp_`, through
    `torch.optim.swa_utils.get_ema_multi_avg_fn`); the first update takes the weights as they are.

    Args:
        decay: the weight of the old average, in [0, 1] (default 0.999).
        every_n_steps: average after every this many optimizer steps (default 1).
        use_buffers: average the floating buffers too (e.g. BatchNorm's running statistics); else they keep the
            training net's values (default True).
    """

    needs_every_step = True

    def __init__(self, decay: float = 0.999, every_n_steps: int = 1, use_buffers: bool = True):
        if isinstance(decay, bool) or not isinstance(decay, (int, float)) or not 0.0 <= decay <= 1.0:
            raise ValueError(f"EMA: decay must be a number in [0, 1], e.g. 0.999, got {decay!r}")
        check_positive_int(every_n_steps, "EMA: every_n_steps")
        super().__init__(use_buffers)
        self.decay, self.every_n_steps = decay, every_n_steps
        self.steps = 0

    def _averaging_function(self):
        return get_ema_multi_avg_fn(self.decay)

    def _start(self, saved: dict) -> None:
        self.steps = saved.get("steps", 0)

    def on_train_batch_end(self, batch, logs=None):
        if not self.model.position.whole_windows:
            return   # a micro-step: no optimizer step yet
        self.steps += 1
        if self.steps % self.every_n_steps == 0:
            self.average()

    def _own_state(self) -> dict:
        return {"steps": self.steps}


class SWA(WeightAveraging):
    """Stochastic weight averaging: from epoch `start_epoch` (counted from 0) on, SWALR anneals the learning rate to
    `swa_lr` over `annealing_epochs` epochs and the weights at the end of each epoch join an equal average
    (`torch.optim.swa_utils.get_swa_multi_avg_fn`). When the fit ends the net holds the average and, if it has
    BatchNorm layers, their statistics are recomputed for it over the training data (`update_bn`, averaged over
    the ranks).

    Args:
        swa_lr: the learning rate SWALR anneals to; scaled with the fit's `lr_scaling` as the Model's lr is.
        start_epoch: the first epoch whose weights are averaged (default 0).
        annealing_epochs: epochs of the annealing (default 10; 0: swa_lr at once).
        annealing_strategy: "cos" (default) or "linear".
    """

    def __init__(self, swa_lr: float, start_epoch: int = 0, annealing_epochs: int = 10,
                 annealing_strategy: str = "cos"):
        check_positive_number(swa_lr, "SWA: swa_lr")
        check_non_negative_int(start_epoch, "SWA: start_epoch", "an epoch number >= 0")
        check_non_negative_int(annealing_epochs, "SWA: annealing_epochs", "a number of epochs >= 0")
        if annealing_strategy not in ("cos", "linear"):
            raise ValueError(f"SWA: annealing_strategy must be 'cos' or 'linear', got {annealing_strategy!r}")
        super().__init__(use_buffers=False)
        self.swa_lr, self.start_epoch = swa_lr, start_epoch
        self.annealing_epochs, self.annealing_strategy = annealing_epochs, annealing_strategy
        self.scheduler: SWALR | None = None
        self.epoch = self.averaged_epoch = -1
        self.scheduler_steps: int | None = None   # a resumed SWALR's step count, until it is rebuilt

    def _averaging_function(self):
        return get_swa_multi_avg_fn()

    def _start(self, saved: dict) -> None:
        if self.model.scheduler is not None:
            raise ValueError("SWA sets the learning rate from start_epoch on (SWALR), which the Model's scheduler "
                             "would fight: build the Model without scheduler=, or use EMA instead of SWA")
        self.averaged_epoch = saved.get("averaged_epoch", -1)
        self.scheduler, self.scheduler_steps = None, saved.get("scheduler_steps")

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch
        if epoch >= self.start_epoch and self.scheduler is None:
            # in the user's scale, as the optimizer's rates are during a fit: each step takes them scaled
            self.scheduler = SWALR(self.model.optimizer, self.swa_lr, self.annealing_epochs, self.annealing_strategy)
            if self.scheduler_steps is not None:   # resumed: where its annealing stood
                self.scheduler._step_count, self.scheduler.last_epoch = self.scheduler_steps, self.scheduler_steps - 1

    def _average_epoch(self) -> None:
        """This epoch's weights into the average, once: before its validation, else at its end."""
        if self.epoch >= self.start_epoch and self.averaged_epoch != self.epoch:
            self.average()
            self.averaged_epoch = self.epoch

    def on_test_begin(self, logs=None):
        if self.running:
            self._average_epoch()
        super().on_test_begin(logs)

    def on_epoch_end(self, epoch, logs=None):
        self._average_epoch()
        if self.scheduler is not None:
            self.scheduler.step()

    def on_train_end(self, logs=None):
        if self.scheduler is not None:   # SWALR holds the fit's optimizer: only its place in the annealing stays
            self.scheduler_steps, self.scheduler = self.scheduler._step_count, None
        super().on_train_end(logs)

    def _own_state(self) -> dict:
        steps = self.scheduler._step_count if self.scheduler is not None else self.scheduler_steps
        return {"averaged_epoch": self.averaged_epoch, "scheduler_steps": steps}

    def _finish(self) -> None:
        """BatchNorm statistics for the averaged weights: one pass over this rank's training batches, averaged over
        the ranks, loaded into the net through the strategy."""
        model = self.model
        if not any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in model.net.modules()):
            return
        net, precision = model._training.module_for_eval(), model.precision
        inputs = ([split_batch(precision.convert_input(batch))[0]] for batch in model.running.train_batches)
        update_bn(inputs, _Call(net))
        state = self._clone_net_state()
        for name, module in net.named_modules():
            if isinstance(module, torch.nn.modules.batchnorm._BatchNorm):
                for buffer in ("running_mean", "running_var"):
                    state[f"{name}.{buffer}"] = model.strategy.reduce(getattr(module, buffer).detach().clone(),
                                                                      "mean")
        model.load_net_state(state)


class _Call(torch.nn.Module):
    """The net called with a batch's inputs as the loop calls it (a tuple: positional, a dict: keywords)."""

    def __init__(self, net: torch.nn.Module):
        super().__init__()
        self.net = net

    def forward(self, inputs):
        if isinstance(inputs, tuple):
            return self.net(*inputs)
        return self.net(**inputs) if isinstance(inputs, dict) else self.net(inputs)
