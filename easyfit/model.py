"""Model: a plain nn.Module with its loss, optimizer and metrics, trained with one call to fit."""
from __future__ import annotations

import os
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from easyfit.callbacks.base import CallbackList, callback_list, fit_returned
from easyfit.callbacks.history import History
from easyfit.data.results import is_numpy_input, prediction_result, scores_result
from easyfit.distributed.environments import launch_identity
from easyfit.distributed.from_rank_zero import (
    reissue,
    restore_callback_attributes,
)
from easyfit.distributed.run_options import RunOptions
from easyfit.distributed.strategies.base import Strategy
from easyfit.distributed.strategies.states import Fit
from easyfit.distributed.strategy_parts.construction import prepare_for_state
from easyfit.parts.losses import resolve_loss
from easyfit.parts.metrics import MetricSet, metric_names
from easyfit.parts.optimizers import build_optimizer, build_scheduler, optimizer_name, parameter_groups
from easyfit.parts.precision import Precision
from easyfit.saving import model_state, net_weights
from easyfit.saving.checkpoint import load_checkpoint_file, save_checkpoint_file
from easyfit.saving.export import example_of, export_net
from easyfit.saving.resume import EpochPosition
from easyfit.training.call_kind import CallKind
from easyfit.training.fit_options import FitOptions, LoopOptions
from easyfit.training.on_batch import OnBatchCalls
from easyfit.training.on_rank import EVALUATE, FIT, PREDICT, call_on_rank, fit_callbacks
from easyfit.training.plan import plan_call
from easyfit.training.running_call import LastCall, RunningCall
from easyfit.training.steps import ModelSteps
from easyfit.tuning import SWEEP_OPTIONS, batch_size_finder
from easyfit.utils.checks import check_model_arguments
from easyfit.utils.options import call_arguments, given, takes_options

#: reads and loads the state of plain (unwrapped, unsharded) objects
PLAIN = Strategy()


class Model(OnBatchCalls):
    """Keras-style training for any torch.nn.Module.

    Args:
        net: the module to train; after `fit` it holds the trained weights.
        loss: a name ("cross_entropy", "mse", ...), "model" (the loss the net returns itself: a transformers model
            given labels=), an nn.Module, or a callable (output, target) -> scalar.
        optimizer: a name ("adam", "sgd", ...), an optimizer over `net`'s parameters, or a factory params -> Optimizer.
        metrics: names ("accuracy", "f1", "mae", ...) or torchmetrics objects; a dict names them.
        lr: learning rate for an optimizer given by name (each name has a sensible default).
        scheduler: an LR scheduler over the optimizer, or a factory optimizer -> scheduler.
        scheduler_interval: step the scheduler every "epoch" (default) or every optimizer "step".
        **optimizer_options: options of an optimizer given by name (momentum=0.9, weight_decay=, betas=, ...).
    """

    def __init__(self, net: nn.Module, loss: Any = "cross_entropy", optimizer: Any = "adam", metrics: Any = None,
                 *, lr: float | None = None, scheduler: Any = None, scheduler_interval: str = "epoch",
                 **optimizer_options):
        if not isinstance(net, nn.Module):
            raise TypeError(f"net must be a torch.nn.Module, got {type(net).__name__}")
        self.net = net
        self.running: RunningCall | None = None   # the call running on this Model, None outside one
        self.compile(optimizer, loss, metrics, lr=lr, scheduler=scheduler, scheduler_interval=scheduler_interval,
                     **optimizer_options)
        self.history = History()   # the last fit's, kept after it (fit returns it)
        self.completed_epochs = 0
        self.position = EpochPosition()   # how far the current epoch has trained (for mid-epoch checkpoints)
        self._last_call = LastCall(Strategy(), Precision("32"), CallbackList([self.history], self, {}))
        self.compiled_steps = ModelSteps()   # fit(compile=...): kept between calls, so nothing compiles twice
        self._input_example = None   # two samples of the last call's first batch: what export traces with,
        #                              kept until the next call

    def compile(self, optimizer: Any = "adam", loss: Any = "cross_entropy", metrics: Any = None, *,
                lr: float | None = None, scheduler: Any = None, scheduler_interval: str = "epoch",
                **optimizer_options) -> None:
        """Keras' compile: (re)set the optimizer, loss and metrics, e.g. of a `Model(net)` built with the net alone;
        the arguments are Model's. The net's weights and the history are kept; the optimizer starts afresh."""
        check_model_arguments(optimizer, metrics, lr, scheduler_interval)
        net = self.net
        self._loss_fn = resolve_loss(loss)
        self._optimizer = build_optimizer(optimizer, net, lr, optimizer_options)
        self.spec = {"loss": loss if isinstance(loss, str) else None, "optimizer": optimizer_name(self.optimizer),
                     "lr": lr, "metrics": metric_names(metrics), "param_groups": parameter_groups(self.optimizer, net),
                     "optimizer_options": dict(optimizer_options) if isinstance(optimizer, str) else {}}
        self._scheduler = build_scheduler(scheduler, self.optimizer)
        self.scheduler_interval = scheduler_interval
        self.metrics = MetricSet(metrics, self.loss_fn)

    @property
    def layers(self) -> list[nn.Module]:
        """The net's top-level layers (its child modules, in order), as Keras' `model.layers`."""
        return list(self.net.children())

    # --- what a running call trains with (its RunningCall), else the Model's own --------
    @property
    def optimizer(self):
        """The optimizer that trains: during fit the one the strategy set up, else the Model's."""
        training = self._training
        return self._optimizer if training is None else training.optimizer

    @property
    def scheduler(self):
        training = self._training
        return self._scheduler if training is None else training.scheduler

    @property
    def loss_fn(self):
        """The loss: during fit the fit's (weighted when weights were given), else the Model's."""
        running = self.running
        return self._loss_fn if running is None or running.loss_fn is None else running.loss_fn

    @property
    def strategy(self) -> Strategy:
        """The strategy of the running call, else of the last one."""
        return (self.running or self._last_call).strategy

    @property
    def _training(self) -> Fit | None:
        """The fit's own object (what the strategy's setup returned), while a fit trains."""
        return None if self.running is None else self.running.training

    @property
    def _lr_multiplier(self) -> float:
        return 1.0 if self.running is None else self.running.lr_multiplier

    @property
    def _callbacks(self) -> CallbackList:
        """The running fit's callbacks, else the last fit's (whose states `save` writes)."""
        running = self.running
        return self._last_call.callbacks if running is None or running.callbacks is None else running.callbacks

    @property
    def stop_training(self) -> bool:
        """Set it in a callback to end the fit (every rank stops at the same step); after it, whether it stopped."""
        return (self.running or self._last_call).stop_training

    @stop_training.setter
    def stop_training(self, value: bool) -> None:
        if self.running is not None:
            self.running.stop_training = bool(value)
        else:
            self._last_call = replace(self._last_call, stop_training=bool(value))

    # --- identity (meaningful inside fit, in every process) -----------------------------
    @property
    def is_global_zero(self) -> bool:
        return self.global_rank == 0

    @property
    def global_rank(self) -> int:
        """This process's rank: the last multi-process call's, or before any, what the launcher of this process says."""
        return ((self.running or self._last_call).identity or launch_identity())[0]

    @property
    def world_size(self) -> int:
        return ((self.running or self._last_call).identity or launch_identity())[1]

    # --- public API ---------------------------------------------------------------------
    @takes_options(FitOptions, RunOptions)
    def fit(self, x=None, y=None, batch_size=32, epochs=1, verbose="auto", callbacks=None, validation_split=0.0,
            validation_data=None, shuffle=True, class_weight=None, sample_weight=None, initial_epoch=0,
            steps_per_epoch=None, validation_steps=None, validation_batch_size=None, validation_freq=1, *, seed=0,
            resume_from=None, gradient_accumulation_steps=1, gradient_clip_val=None, lr_scaling="linear",
            lr_warmup_epochs=0, max_restarts=None, fault_tolerance=None, fault_tolerance_every_n_steps=None,
            steps_per_execution="auto", devices="auto", accelerator="auto", strategy="auto", launcher="auto",
            num_nodes=1, precision=None, compile=False, auto_select_gpus=False, process_group_backend=None,
            num_workers=0, replace_sampler=True, collate_fn=None, **unknown) -> History:
        """Train the net; the History of the fit (`history.history`: loss, metrics and their val_ twins per epoch).

        Args:
            x: inputs: an array or tensor (a list of them for several inputs), a Dataset, a DataLoader (used as
                given) or any re-iterable of batches `(x, y)`, `(x1, x2, ..., y)` or dicts.
            y: targets for array / tensor `x`; None when `x` yields its own targets.
        """
        options, run = given(locals(), FitOptions, RunOptions)
        history = self._dispatch(FIT, run, x, y, options)
        self.net.eval()   # calling the net now runs inference, as predict does
        fit_returned(callback_list(options.callbacks))   # outside every launcher: OptunaPruning raises TrialPruned
        return history

    @takes_options(LoopOptions, RunOptions)
    def evaluate(self, x=None, y=None, batch_size=32, verbose=1, callbacks=None, return_dict=False, *,
                 devices="auto", accelerator="auto", strategy="auto", launcher="auto", num_nodes=1, precision=None,
                 compile=False, auto_select_gpus=False, process_group_backend=None, num_workers=0,
                 replace_sampler=True, collate_fn=None, **unknown):
        """Loss and metrics over the whole data, exact on any number of processes: the loss alone when there are
        no metrics, else [loss, metric, ...] in the order given to the Model.

        Args:
            x, y: the data, in any form fit takes.
            return_dict: {"loss": ..., "accuracy": ...} instead of a list (default False).
        """
        loop, run = given(locals(), LoopOptions, RunOptions)
        logs = self._dispatch(EVALUATE, run, x, y, loop)
        return scores_result(logs, self.metrics.names, return_dict)

    @takes_options(LoopOptions, RunOptions, verbose=0)
    def predict(self, x, batch_size=32, verbose=0, callbacks=None, *, devices="auto", accelerator="auto",
                strategy="auto", launcher="auto", num_nodes=1, precision=None, compile=False, auto_select_gpus=False,
                process_group_backend=None, num_workers=0, replace_sampler=True, collate_fn=None, **unknown):
        """The net's outputs for every sample, in input order, on the CPU: numpy arrays for numpy input, tensors
        otherwise; float32 under mixed precision.

        Args:
            x: the inputs, in any form fit takes; every element of a batch goes to the net (no targets).
        """
        loop, run = given(locals(), LoopOptions, RunOptions)
        outputs = self._dispatch(PREDICT, run, x, None, loop)
        return prediction_result(outputs, is_numpy_input(x), self.precision.autocast_dtype is not None)

    @property
    def precision(self) -> Precision:
        """The precision plugin of the last (or running) call."""
        return (self.running or self._last_call).precision

    def save(self, path: str | os.PathLike) -> None:
        """Write weights, optimizer, scheduler, scaler, epoch and history to `path`, atomically.

        Inside fit (a callback) call it on every rank: the strategy decides who writes what, and for a sharded
        backend reading the state is a collective. After fit the full state is back in this process, so it may be
        called on every rank or under `if model.is_global_zero:`; only global rank 0 writes."""
        state = self.checkpoint_state()
        if self._training is not None:
            self._training.save_checkpoint(os.fspath(path), state)
        elif self.is_global_zero:
            save_checkpoint_file(os.fspath(path), state)

    def net_state(self) -> dict:
        """The net's full state dict; inside fit it is read through the strategy (call it on every rank)."""
        return self._state_owner().module_state()

    def load_net_state(self, state: dict) -> None:
        """Load a full state dict into the net; inside fit through the strategy (call it on every rank)."""
        self._state_owner(loading=True).load_module_state(state)

    def _state_owner(self, loading: bool = False) -> Fit:
        """Whose state is read and loaded: the fit's objects inside fit (through its strategy); the Model's own
        after, the plain way."""
        if self._training is not None:
            return self._training
        prepare_for_state(self.net, loading)   # a net built sharded that holds no weights yet
        return Fit(strategy=PLAIN, net=self.net, optimizer=self.optimizer, scheduler=self.scheduler)

    @classmethod
    def load(cls, path: str | os.PathLike, net: nn.Module, loss: Any = None, optimizer: Any = None,
             metrics: Any = None, trusted: bool = False, **kwargs) -> Model:
        """A Model around `net` with the weights, optimizer state and history saved at `path`, read as data
        (`trusted=True`: any object, only for a file you trust). Loss, optimizer and metrics given by name at save
        time are restored by name; pass them to override. A `.safetensors` file holds weights only: the Model gets
        them, and the loss, optimizer and metrics given (else Model's defaults)."""
        if net_weights.is_safetensors(path):
            given = {"loss": loss, "optimizer": optimizer, "metrics": metrics}
            model = cls(net, **{name: value for name, value in given.items() if value is not None}, **kwargs)
            model.load_weights(path)
            return model
        state = load_checkpoint_file(path, trusted=trusted)
        args, keywords = model_state.saved_arguments(state, path, net, loss, optimizer, metrics, kwargs)
        model = cls(net, *args, **keywords)
        model.restore(state)
        return model

    @takes_options(FitOptions, RunOptions, leave_out=SWEEP_OPTIONS, keyword_only=True, verbose=0)
    def find_lr(self, x=None, y=None, *, start_lr=1e-7, end_lr=10.0, num_steps=200, smoothing=0.05, divergence=4.0,
                plot=False, batch_size=32, verbose=0, callbacks=None, shuffle=True, class_weight=None,
                sample_weight=None, initial_epoch=0, validation_steps=None, validation_batch_size=None,
                validation_freq=1, seed=0, gradient_accumulation_steps=1, gradient_clip_val=None, lr_scaling="linear",
                lr_warmup_epochs=0, max_restarts=None, fault_tolerance=None, fault_tolerance_every_n_steps=None,
                steps_per_execution="auto", devices="auto", accelerator="auto", strategy="auto", launcher="auto",
                num_nodes=1, precision=None, compile=False, auto_select_gpus=False, process_group_backend=None,
                num_workers=0, replace_sampler=True, collate_fn=None, **unknown):
        """The learning-rate range test: an `LRFinderResult` with the curve and the suggested `lr`; the net,
        optimizer and RNG are left exactly as before. See easyfit.tuning.lr_finder and docs/api.md."""
        arguments = call_arguments(locals())
        from easyfit.tuning.lr_finder import find_lr  # on first use: its import is not `import easyfit`'s cost
        return find_lr(self, **arguments)

    @takes_options(FitOptions, RunOptions, leave_out=batch_size_finder.TRIAL_OPTIONS, keyword_only=True)
    def find_batch_size(self, x=None, y=None, *, start=1, max_batch_size=None, max_memory=None, steps=2,
                        callbacks=None, class_weight=None, sample_weight=None, initial_epoch=0, validation_steps=None,
                        validation_batch_size=None, validation_freq=1, seed=0, gradient_accumulation_steps=1,
                        gradient_clip_val=None, lr_warmup_epochs=0, max_restarts=None, fault_tolerance=None,
                        fault_tolerance_every_n_steps=None, steps_per_execution="auto", devices="auto",
                        accelerator="auto", strategy="auto", launcher="auto", num_nodes=1, precision=None,
                        compile=False, auto_select_gpus=False, process_group_backend=None, num_workers=0,
                        replace_sampler=True, collate_fn=None, **unknown) -> int:
        """The largest per-process batch size that trains (every process agrees on the smallest answer); the state
        is left as before. See easyfit.tuning.batch_size_finder and docs/api.md."""
        return batch_size_finder.find_batch_size(self, **call_arguments(locals()))

    def summary(self, print_fn=print, input_example=None) -> str:
        """A Keras-like table of layers, output shapes (when `input_example` is given: also `summary(x)`) and
        parameter counts, printed with `print_fn` (None: not printed) and returned. Inside a fit that shards the
        net (tensor parallelism, FSDP), it describes the sharded net: each sharded parameter's shape on this rank."""
        from easyfit.training.summary import described_net, print_summary
        training_net = self._training.net if self._training is not None else None
        return print_summary(described_net(self.net, training_net), print_fn, input_example)

    # --- weights and single batches ----------------------------------------------------
    def get_weights(self) -> list:
        """The net's weights (parameters and buffers, in `state_dict` order) as copied numpy arrays.
        Inside fit, call it on every rank (as `net_state`)."""
        return net_weights.as_arrays(self.net_state())

    def set_weights(self, weights: list) -> None:
        """Load a list of arrays in the order `get_weights` returns them."""
        self.load_net_state(net_weights.from_arrays(self.net_state(), weights))

    def save_weights(self, path: str | os.PathLike) -> None:
        """Write the net's state dict atomically (global rank 0 writes; inside fit call it on every rank);
        `net.load_state_dict(torch.load(path))` reads it; a path ending in `.safetensors` is written in that format."""
        state = self.net_state()
        if self.is_global_zero:
            net_weights.save_state(state, path)

    def load_weights(self, path: str | os.PathLike, trusted: bool = False) -> None:
        """Load `save_weights`' file, `torch.save(net.state_dict())`'s, a `.safetensors` file or a checkpoint's
        (`trusted`: see `load`)."""
        self.load_net_state(net_weights.read_state(path, self.net_state(), trusted))

    def export(self, path: str | os.PathLike, format: str | None = None, input_example: Any = None,
               dtype: torch.dtype = torch.float32) -> None:
        """Write the net as an ONNX file (`format="onnx"`, `*.onnx`) or a torch.export program (`"torch"`, `*.pt2`)
        that serves any batch size without easyfit; the format follows the suffix when not given. It is traced on
        `input_example` (inputs as the net takes them) or the first batch the last fit / evaluate / predict saw, in
        eval mode, in `dtype`; global rank 0 writes, atomically (easyfit.saving.export, docs/api.md)."""
        if self.is_global_zero:
            example = self._input_example if input_example is None else example_of(input_example)
            export_net(self.net, path, format, example, dtype)

    def count_params(self) -> int:
        """The number of parameters of the net (trainable or not; buffers are not parameters)."""
        return sum(p.numel() for p in self.net.parameters())

    # --- checkpoint state ---------------------------------------------------------------
    def checkpoint_state(self) -> dict:
        """Everything needed to resume training exactly (easyfit.saving.model_state)."""
        return model_state.checkpoint_state(self)

    def restore(self, state: dict, training: bool = False) -> None:
        """Load a checkpoint state; with `training`, also the RNG, scaler and callback states (for resuming)."""
        model_state.restore(self, state, training)

    # --- running in one or many processes -----------------------------------------------
    def _dispatch(self, kind: CallKind, run: RunOptions, x, y, options):
        """Run a call of `kind` (FIT, EVALUATE, ...) by its plan: in this process or, through the plan's launcher,
        in every rank."""
        plan = plan_call(self, kind, run, options)
        inputs = {"x": x, "y": y, "options": plan.options}   # the options checked and completed
        if plan.launcher is None:
            return call_on_rank(plan, model=self, **inputs)[0]
        result, state = plan.launcher.start(call_on_rank, plan, model=self, **inputs)
        if state is None:
            return result
        reissue(state.pop("warnings"))   # rank 0 ran in another process: its warnings and state come back
        self._input_example = state.pop("input_example")
        if kind.trains:   # the ranks trained copies: bring rank 0's state into the caller's objects
            self.restore(state)
            model_state.restore_random_states(self, state)   # the next call continues where rank 0's draws ended
            options = plan.options
            callbacks = fit_callbacks(self, options, is_global_zero=True)
            callbacks.load_state_dict(state["callbacks"])
            self._last_call = replace(self._last_call, callbacks=callbacks)
            restore_callback_attributes(options.callbacks, state["callback_attributes"])
            return self.history
        return result
