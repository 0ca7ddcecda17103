"""Model: a plain nn.Module with its loss, optimizer and metrics, trained with one call to fit."""
from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

from easyfit import net_weights
from easyfit.callbacks.backup_and_restore import backup_to_resume
from easyfit.callbacks.base import Callback, CallbackList
from easyfit.callbacks.history import History
from easyfit.callbacks.progress import progress_callbacks
from easyfit.checkpoint import load_checkpoint_file, save_checkpoint_file
from easyfit.compiling import CompiledSteps, check_compile
from easyfit.data import batch_count, make_batches, split_validation
from easyfit.distributed.connector import connect
from easyfit.distributed.environments import launch_identity
from easyfit.distributed.hand_back import callback_attributes, recorded_warnings, reissue, restore_callback_attributes
from easyfit.distributed.memory import estimate
from easyfit.distributed.strategies.base import Strategy
from easyfit.distributed.strategies.construction import check_call, prepare_for_state
from easyfit.distributed.unused_parameters import explain_unused_parameters
from easyfit.first_batch import prepare, prepare_fit_data
from easyfit.loop import Loop, TrainingObjects, TrainingSettings
from easyfit.losses import resolve_loss
from easyfit.lr_scaling import (
    Warmup,
    describe,
    lr_multiplier,
    rescale_learning_rates,
    scaled_learning_rates,
)
from easyfit.metrics import MetricSet, metric_names
from easyfit.optimizers import (
    build_optimizer,
    build_scheduler,
    grouped_parameters,
    optimizer_factory,
    optimizer_name,
    parameter_groups,
)
from easyfit.options import FitOptions, RunOptions, check_fit_options, split_options
from easyfit.precision import Precision, parse_precision
from easyfit.results import is_numpy_input, prediction_result, scores_result
from easyfit.resume import EpochPosition
from easyfit.steps import limit_steps
from easyfit.tensors import sample_count
from easyfit.validation import (
    callback_list,
    check_model_arguments,
    check_positive_int,
    check_verbose,
)
from easyfit.weights import validation_weight, weigh_batches

#: reads and loads the state of plain (unwrapped, unsharded) objects
PLAIN = Strategy()


class Model:
    """Keras-style training for any torch.nn.Module.

    Args:
        net: the module to train; after `fit` it holds the trained weights.
        loss: a name ("cross_entropy", "mse", ...), an nn.Module, or a callable (output, target) -> scalar.
        optimizer: a name ("adam", "sgd", ...), an optimizer over `net`'s parameters, or a factory params -> Optimizer.
        metrics: names ("accuracy", "f1", "mae", ...) or torchmetrics objects; a dict names them.
        lr: learning rate for an optimizer given by name (each name has a sensible default).
        scheduler: an LR scheduler over the optimizer, or a factory optimizer -> scheduler.
        scheduler_interval: step the scheduler every "epoch" (default) or every optimizer "step".
    """

    def __init__(self, net: nn.Module, loss: Any = "cross_entropy", optimizer: Any = "adam", metrics: Any = None,
                 *, lr: float | None = None, scheduler: Any = None, scheduler_interval: str = "epoch"):
        if not isinstance(net, nn.Module):
            raise TypeError(f"net must be a torch.nn.Module, got {type(net).__name__}")
        if scheduler_interval not in ("epoch", "step"):
            raise ValueError(f"scheduler_interval must be 'epoch' or 'step', got {scheduler_interval!r}")
        check_model_arguments(optimizer, metrics, lr)
        self.net = net
        self.loss_fn = resolve_loss(loss)
        self.optimizer = build_optimizer(optimizer, net, lr)
        self.spec = {"loss": loss if isinstance(loss, str) else None, "optimizer": optimizer_name(self.optimizer),
                     "lr": lr, "metrics": metric_names(metrics), "param_groups": parameter_groups(self.optimizer, net)}
        self.scheduler = build_scheduler(scheduler, self.optimizer)
        self.scheduler_interval = scheduler_interval
        self.metrics = MetricSet(metrics, self.loss_fn)
        self.history = History()
        self.strategy: Strategy = Strategy()
        self._training: TrainingObjects | None = None   # what the strategy's setup returned, while a fit runs
        self._identity: tuple[int, int] | None = None   # (rank, world size) of the last multi-process call
        self.stop_training = False
        self.completed_epochs = 0
        self.position = EpochPosition()   # how far the current epoch has trained (for mid-epoch checkpoints)
        self._precision = Precision("32")
        self._lr_multiplier = 1.0
        self._callbacks = CallbackList([self.history], self, {})
        self.compiled_steps = CompiledSteps()   # fit(compile=...): kept between calls, so nothing compiles twice

    # --- identity (meaningful inside fit, in every process) -----------------------------
    @property
    def is_global_zero(self) -> bool:
        return self.global_rank == 0

    @property
    def global_rank(self) -> int:
        """This process's rank: the last multi-process call's, or before any, what the launcher of this process says."""
        return (self._identity or launch_identity())[0]

    @property
    def world_size(self) -> int:
        return (self._identity or launch_identity())[1]

    # --- public API ---------------------------------------------------------------------
    def fit(self, x=None, y=None, **kwargs) -> History:
        """Train on (x, y) arrays/tensors, a Dataset, a DataLoader or an iterable of batches.

        `epochs` is the index of the last epoch, as in Keras: resuming a checkpoint saved after epoch 4 with
        epochs=8 trains epochs 5 to 8. See docs/api.md for every option."""
        run, options = split_options(kwargs, RunOptions, FitOptions)
        check_fit_options(options)
        history = self._dispatch("_fit_in_process", run, x=x, y=y, options=options)
        self.net.eval()   # calling the net now runs inference, as predict does
        return history

    def evaluate(self, x=None, y=None, batch_size: int = 32, verbose: int = 1, callbacks=None,
                 return_dict: bool = False, **kwargs):
        """Loss and metrics over the whole data, exact on any number of processes: the loss alone when there are
        no metrics, else [loss, metric, ...] in the order given to the Model; {"loss": ..., ...} with return_dict."""
        (run,) = split_options(kwargs, RunOptions)
        check_positive_int(batch_size, "batch_size")
        check_verbose(verbose)
        logs = self._dispatch("_evaluate_in_process", run, x=x, y=y, batch_size=batch_size, verbose=verbose,
                              callbacks=callback_list(callbacks))
        return scores_result(logs, self.metrics.names, return_dict)

    def predict(self, x, batch_size: int = 32, verbose: int = 0, callbacks=None, **kwargs):
        """The net's outputs for every sample, in input order, on the CPU: numpy arrays for numpy input, tensors
        otherwise; float32 under mixed precision."""
        (run,) = split_options(kwargs, RunOptions)
        check_positive_int(batch_size, "batch_size")
        check_verbose(verbose)
        outputs = self._dispatch("_predict_in_process", run, x=x, y=None, batch_size=batch_size, verbose=verbose,
                                 callbacks=callback_list(callbacks))
        return prediction_result(outputs, is_numpy_input(x), self._precision.autocast_dtype is not None)

    @property
    def precision(self) -> Precision:
        """The precision plugin of the last (or running) call."""
        return self._precision

    def save(self, path: str | os.PathLike) -> None:
        """Write weights, optimizer, scheduler, scaler, epoch and history to `path`, atomically.

        Inside fit (a callback) call it on every rank: the strategy decides who writes what, and for a sharded
        backend reading the state is a collective. After fit the full state is back in this process, so it may be
        called on every rank or under `if model.is_global_zero:`; only global rank 0 writes."""
        state = self.checkpoint_state()
        if self._training is not None:
            self.strategy.save_checkpoint(os.fspath(path), state)
        elif self.is_global_zero:
            save_checkpoint_file(os.fspath(path), state)

    def net_state(self) -> dict:
        """The net's full state dict; inside fit it is read through the strategy (call it on every rank)."""
        strategy, objects = self._state_owner()
        return strategy.module_state(objects.net)

    def load_net_state(self, state: dict) -> None:
        """Load a full state dict into the net; inside fit through the strategy (call it on every rank)."""
        strategy, objects = self._state_owner(loading=True)
        strategy.load_module_state(objects.net, state)

    def _state_owner(self, loading: bool = False) -> tuple[Strategy, TrainingObjects]:
        """Who reads and loads state: the strategy and its training objects inside fit; the plain objects after."""
        if self._training is not None:
            return self.strategy, self._training
        prepare_for_state(self.net, loading)   # a net built sharded that holds no weights yet
        return PLAIN, TrainingObjects(self.net, self.optimizer, self.scheduler)

    @classmethod
    def load(cls, path: str | os.PathLike, net: nn.Module, loss: Any = None, optimizer: Any = None,
             metrics: Any = None, **kwargs) -> Model:
        """A Model around `net` with the weights, optimizer state and history saved at `path`.

        Loss, optimizer and metrics given by name at save time are restored by name; pass them to override."""
        state = load_checkpoint_file(path)
        spec = state.get("spec", {})
        if loss is None and spec.get("loss") is None:
            raise ValueError(f"{os.fspath(path)!r} was saved with a loss easyfit has no name for (an object or a "
                             "function); pass the same loss to Model.load(..., loss=...)")
        if optimizer is None and spec.get("optimizer") is None:
            raise ValueError(f"{os.fspath(path)!r} was saved with an optimizer easyfit has no name for; "
                             "pass the same kind to Model.load(..., optimizer=...) to restore its state")
        if optimizer is None and spec.get("param_groups"):   # rebuilt in the saved groups; their settings load next
            optimizer = optimizer_factory(spec["optimizer"])(grouped_parameters(net, spec["param_groups"]))
        model = cls(net, loss if loss is not None else spec["loss"],
                    optimizer if optimizer is not None else spec["optimizer"],
                    metrics if metrics is not None else spec.get("metrics"),
                    lr=kwargs.pop("lr", spec.get("lr") if optimizer is None else None),
                    **kwargs)
        model.restore(state)
        return model

    def find_lr(self, x=None, y=None, **kwargs):
        """The learning-rate range test: an `LRFinderResult` with the curve and the suggested `lr`; the net,
        optimizer and RNG are left exactly as before. See easyfit.lr_finder and docs/api.md."""
        from easyfit.lr_finder import find_lr
        return find_lr(self, x, y, **kwargs)

    def find_batch_size(self, x=None, y=None, **kwargs) -> int:
        """The largest per-process batch size that trains (every process agrees on the smallest answer); the state
        is left as before. See easyfit.batch_size_finder and docs/api.md."""
        from easyfit.batch_size_finder import find_batch_size
        return find_batch_size(self, x, y, **kwargs)

    def _find_batch_size_in_process(self, run: RunOptions, **inputs) -> int:
        from easyfit.batch_size_finder import search_in_process
        return search_in_process(self, run, **inputs)

    def summary(self, print_fn=print, input_example=None) -> str:
        """A Keras-like table of layers, output shapes (when `input_example` is given) and parameter counts."""
        from easyfit.summary import summarize
        text = summarize(self.net, input_example)
        if print_fn is not None:
            print_fn(text)
        return text

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
        `net.load_state_dict(torch.load(path))` reads it."""
        state = self.net_state()
        if self.is_global_zero:
            net_weights.save_state(state, path)

    def load_weights(self, path: str | os.PathLike) -> None:
        """Load a file from `save_weights` or `torch.save(net.state_dict())`, or the weights of a checkpoint."""
        self.load_net_state(net_weights.read_state(path))

    def count_params(self) -> int:
        """The number of parameters of the net (trainable or not; buffers are not parameters)."""
        return sum(p.numel() for p in self.net.parameters())

    def train_on_batch(self, x, y=None, return_dict: bool = False, **kwargs):
        """One optimizer step on exactly this batch; its loss (and metrics) as `evaluate` returns them.

        Takes fit's options (`sample_weight`, `class_weight`, run options); `history` and `completed_epochs` are
        left as they were."""
        history, epochs, callbacks = self.history, self.completed_epochs, self._callbacks
        options = {"devices": 1, "lr_scaling": None, **kwargs}
        try:
            result = self.fit(x, y, epochs=1, batch_size=sample_count(x), shuffle=False, verbose=0, **options)
        finally:
            self.history, self.completed_epochs, self._callbacks = history, epochs, callbacks
        logs = {key: values[-1] for key, values in result.history.items()}
        return scores_result(logs, self.metrics.names, return_dict)

    def test_on_batch(self, x, y=None, return_dict: bool = False, **kwargs):
        """`evaluate` on exactly this batch."""
        return self.evaluate(x, y, batch_size=sample_count(x), verbose=0, return_dict=return_dict,
                             **{"devices": 1, **kwargs})

    def predict_on_batch(self, x, **kwargs):
        """`predict` on exactly this batch."""
        return self.predict(x, batch_size=sample_count(x), verbose=0, **{"devices": 1, **kwargs})

    # --- checkpoint state ---------------------------------------------------------------
    def checkpoint_state(self) -> dict:
        """Everything needed to resume training exactly."""
        strategy, objects = self._state_owner()
        return {
            "spec": self.spec,
            "net": strategy.module_state(objects.net),
            "optimizer": strategy.optimizer_state(objects.optimizer),
            "scheduler": objects.scheduler.state_dict() if objects.scheduler is not None else None,
            "scaler": self._precision.state_dict(),
            "epoch": self.completed_epochs,
            "position": self.position.state_dict(),
            "lr_multiplier": self._lr_multiplier,
            "history": self.history.state_dict(),
            "callbacks": self._callbacks.state_dict(),
            "rng": torch.get_rng_state(),
            "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None,
        }

    def restore(self, state: dict, training: bool = False) -> None:
        """Load a checkpoint state; with `training`, also the RNG, scaler and callback states (for resuming)."""
        strategy, objects = self._state_owner(loading=True)
        strategy.load_module_state(objects.net, state["net"])
        strategy.load_optimizer_state(objects.optimizer, state["optimizer"])
        if objects.scheduler is not None and state.get("scheduler") is not None:
            objects.scheduler.load_state_dict(state["scheduler"])
        # the checkpoint's LRs carry the scaling of the run that saved it; bring them to this run's
        rescale_learning_rates(objects.optimizer, objects.scheduler,
                               self._lr_multiplier / state.get("lr_multiplier", 1.0))
        self.completed_epochs = state["epoch"]
        self.history.load_state_dict(state["history"])
        if training:
            self._precision.load_state_dict(state["scaler"])
            self._callbacks.load_state_dict(state["callbacks"])
            self.position = EpochPosition.from_state(state.get("position"))
            torch.set_rng_state(state["rng"].cpu())
            if state.get("cuda_rng") is not None and torch.cuda.is_available():
                for index, device_state in enumerate(state["cuda_rng"][:torch.cuda.device_count()]):
                    torch.cuda.set_rng_state(device_state.cpu(), index)

    # --- running in one or many processes -----------------------------------------------
    def _dispatch(self, method: str, run: RunOptions, **inputs):
        """Run `method` in this process or, via the strategy's launcher, in every rank."""
        training_memory = estimate(self.net, self.optimizer) if method == "_fit_in_process" else None
        strategy = connect(strategy=run.strategy, devices=run.devices, accelerator=run.accelerator,
                           num_nodes=run.num_nodes, process_group_backend=run.process_group_backend,
                           training_memory=training_memory, auto_select_gpus=run.auto_select_gpus)
        check_call(self.net, method, strategy.trains_built_sharded)
        strategy.check_precision(parse_precision(run.precision or self._precision.name))
        strategy.check_net(self.net)
        check_compile(run.compile, strategy, inputs.get("options"))
        launcher = strategy.launcher
        if launcher is None:
            return self._in_process(strategy, method, run, **inputs)[0]
        result, state = launcher.launch(self._in_process, strategy, method, run, **inputs)
        if state is None:
            return result
        reissue(state.pop("warnings"))   # rank 0 ran in another process: its warnings and state come back
        if method == "_fit_in_process":   # the ranks trained copies: bring rank 0's state into the caller's objects
            self.restore(state)
            options = inputs["options"]
            self._fit_callbacks(options, is_global_zero=True).load_state_dict(state["callbacks"])
            restore_callback_attributes(options.callbacks, state["callback_attributes"])
            return self.history
        return result

    def _in_process(self, strategy: Strategy, method: str, run: RunOptions, **inputs):
        """(result, state to hand back to the caller or None), for this rank."""
        strategy.setup_environment()
        self.strategy = strategy
        if strategy.world_size > 1:   # a rank-local call (strategy="single" among ranks) keeps the rank's identity
            self._identity = (strategy.global_rank, strategy.world_size)
        self._precision = strategy.precision_plugin(self._precision, run.precision)
        launcher = strategy.launcher
        hand_back = launcher is not None and not launcher.rank_zero_in_caller and strategy.is_global_zero
        try:
            with recorded_warnings(hand_back) as caught, self.compiled_steps.running(run.compile, strategy):
                result = getattr(self, method)(run, **inputs)
            if not hand_back:
                return result, None
            if method != "_fit_in_process":
                return result, {"warnings": caught}
            # a History refers to the whole Model: the caller rebuilds its own from the state instead
            return None, {**self.checkpoint_state(), "warnings": caught,
                          "callback_attributes": callback_attributes(inputs["options"].callbacks)}
        except RuntimeError as error:   # DDP's unused-parameter error, with the parameters' names and the fix
            explained = explain_unused_parameters(error, self.net)
            if explained is None:
                raise
            raise explained from error
        finally:
            strategy.teardown()

    def _fit_in_process(self, run: RunOptions, x, y, options: FitOptions) -> History:
        strategy, precision = self.strategy, self._precision
        validation_data, val_weight = validation_weight(options.validation_data)   # (x, y, w) -> (x, y), w
        if options.validation_split:
            if validation_data is not None:
                raise ValueError("pass either validation_data or validation_split, not both")
            (x, y), validation_data = split_validation(x, y, options.validation_split, precision.float_dtype)
        train = make_batches(x, y, batch_size=options.batch_size, strategy=strategy, train=True,
                             shuffle=options.shuffle, seed=options.seed, num_workers=run.num_workers,
                             replace_sampler=run.replace_sampler, float_dtype=precision.float_dtype)
        val = None
        if validation_data is not None:
            val = make_batches(*_as_pair(validation_data),
                               batch_size=options.validation_batch_size or options.batch_size, strategy=strategy,
                               train=False, num_workers=run.num_workers, replace_sampler=run.replace_sampler,
                               float_dtype=precision.float_dtype)
        loss_fn = weighted_loss = self.loss_fn
        if options.sample_weight is not None or options.class_weight is not None or val_weight is not None:
            train, val, weighted_loss = weigh_batches(loss_fn, train, val, options.sample_weight,
                                                      options.class_weight, val_weight, bool(options.validation_split))
        train = limit_steps(train, options.steps_per_epoch, "training")
        val = None if val is None else limit_steps(val, options.validation_steps, "validation")
        precision.convert_module(self.net)
        settings = TrainingSettings(options.batch_size, options.gradient_accumulation_steps,
                                    options.gradient_clip_val, self.scheduler_interval, precision.name)
        strategy.configure_training(settings)
        user_optimizer, user_scheduler = self.optimizer, self.scheduler
        objects = TrainingObjects(*strategy.setup(self.net, user_optimizer, user_scheduler))
        # from here until the fit ends, Model and the callbacks use what the strategy returned
        self._training, self.optimizer, self.scheduler = objects, objects.optimizer, objects.scheduler
        self.loss_fn = weighted_loss   # the loop computes this fit's loss (weighted when weights were given)
        try:
            self._train(options, train, val, settings, objects)
        finally:
            self._training, self.optimizer, self.scheduler = None, user_optimizer, user_scheduler
            self.loss_fn = loss_fn
        strategy.hand_back(self.net, user_optimizer, objects.net, objects.optimizer)   # every rank, on success
        return self.history

    def _train(self, options: FitOptions, train, val, settings: TrainingSettings, objects: TrainingObjects) -> None:
        strategy, optimizer = self.strategy, objects.optimizer
        multiplier = lr_multiplier(options.lr_scaling, strategy.batch_factor)
        with scaled_learning_rates(optimizer, objects.scheduler, multiplier):
            self._lr_multiplier = multiplier
            self.history = History()
            params = self._fit_params(options, strategy, optimizer, multiplier, batch_count(train))
            callbacks = self._fit_callbacks(options, strategy.is_global_zero, params)
            self._callbacks = callbacks
            initial_epoch = options.initial_epoch
            resume_from = backup_to_resume(options.callbacks) or options.resume_from
            if resume_from is not None:
                self.restore(strategy.load_checkpoint(resume_from), training=True)
                initial_epoch = self.completed_epochs
            warmup = self._warmup(options, train, optimizer, multiplier, initial_epoch, self.position)
            if options.verbose and strategy.is_global_zero:
                print(params["summary"])
            self.stop_training = False
            prepare_fit_data(self, objects.net, train, val)   # after a resume: a bad checkpoint runs no forward
            try:
                Loop(self, strategy, callbacks, objects, settings, warmup).fit(
                    train, val, options.epochs, initial_epoch, options.validation_freq)
            finally:
                self._lr_multiplier = 1.0

    def _fit_callbacks(self, options: FitOptions, is_global_zero: bool, params: dict | None = None) -> CallbackList:
        """The History, the progress display and the user's callbacks of a fit, in that order."""
        display = progress_callbacks(options.verbose, is_global_zero)
        return CallbackList([self.history, *display, *options.callbacks], self, params or {})

    @staticmethod
    def _warmup(options: FitOptions, train, optimizer, multiplier: float, initial_epoch: int,
                position: EpochPosition) -> Warmup | None:
        """The LR ramp of the first `lr_warmup_epochs` epochs; a resumed fit continues it where it stood."""
        if not options.lr_warmup_epochs:
            return None
        num_batches = batch_count(train)
        if num_batches is None:
            raise ValueError("lr_warmup_epochs needs data whose number of batches is known (len()); "
                             "this data has no length")
        accumulate = options.gradient_accumulation_steps
        steps_per_epoch = -(-num_batches // accumulate)   # a short last window steps too
        return Warmup(optimizer, multiplier, options.lr_warmup_epochs * steps_per_epoch,
                      steps_done=initial_epoch * steps_per_epoch + position.batches_done // accumulate)

    def _fit_params(self, options: FitOptions, strategy: Strategy, optimizer, multiplier: float,
                    steps_per_epoch: int | None) -> dict:
        return {
            "epochs": options.epochs, "batch_size": options.batch_size, "verbose": options.verbose,
            "validation_freq": options.validation_freq,
            "validation": options.validation_data is not None or bool(options.validation_split),
            "world_size": strategy.world_size, "batch_factor": strategy.batch_factor,
            "effective_batch_size": options.batch_size * strategy.batch_factor,
            "steps_per_epoch": steps_per_epoch,
            "lr_scaling": options.lr_scaling if multiplier != 1.0 else None, "lr_multiplier": multiplier,
            "strategy": strategy.name, "precision": self._precision.name,
            "summary": describe(options.batch_size, strategy, options.lr_scaling, optimizer, multiplier),
        }

    def _eval_loop(self, verbose: int, callbacks: list[Callback]) -> Loop:
        strategy = self.strategy
        self._precision.convert_module(self.net)
        display = progress_callbacks(verbose, strategy.is_global_zero)
        callback_list = CallbackList([*display, *callbacks], self, {"verbose": verbose})
        return Loop(self, strategy, callback_list, TrainingObjects(self.net))

    def _evaluate_in_process(self, run: RunOptions, x, y, batch_size: int, verbose: int, callbacks) -> dict:
        batches = make_batches(x, y, batch_size=batch_size, strategy=self.strategy, train=False,
                               num_workers=run.num_workers, replace_sampler=run.replace_sampler,
                               float_dtype=self._precision.float_dtype)
        loop = self._eval_loop(verbose, callbacks)
        prepare(self, self.net, batches, "the evaluation data")
        return loop.evaluate(batches)

    def _predict_in_process(self, run: RunOptions, x, y, batch_size: int, verbose: int, callbacks):
        strategy = self.strategy
        batches = make_batches(x, y, batch_size=batch_size, strategy=strategy, train=False,
                               num_workers=run.num_workers, replace_sampler=run.replace_sampler,
                               float_dtype=self._precision.float_dtype)
        loop = self._eval_loop(verbose, callbacks)
        prepare(self, self.net, batches, "the data", targets=False)
        outputs = loop.predict(batches)
        tensors = all(isinstance(output, torch.Tensor) for output in outputs)
        if strategy.world_size == 1 or not getattr(batches, "sharded", False):
            return torch.cat(outputs) if outputs and tensors else outputs
        if not tensors:
            raise TypeError("predict on several processes gathers the outputs as one tensor, but the net returned "
                            f"{type(next(o for o in outputs if not isinstance(o, torch.Tensor))).__name__}; "
                            "predict with strategy='single' (or devices=1) instead")
        local = torch.cat(outputs) if outputs else torch.empty(0, device=strategy.root_device)
        return strategy.gather_outputs(local)


def _as_pair(validation_data) -> tuple:
    """validation_data as (x, y): a 2-tuple of arrays, or a dataset / loader with y=None."""
    if isinstance(validation_data, tuple) and len(validation_data) == 2:
        return validation_data
    return validation_data, None

