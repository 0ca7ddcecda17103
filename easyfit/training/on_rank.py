"""What a fit, evaluate or predict call does in one process (on every rank): build the batches, let the strategy
set up the training objects, run the loop, and hand the trained state back. `Model` dispatches a call here, in this
process or through the strategy's launcher in every rank; the functions take the Model they run for."""
from __future__ import annotations

from typing import Any

import torch

from easyfit.callbacks.backup_and_restore import backup_to_resume
from easyfit.callbacks.base import Callback, CallbackList, exceptions_told
from easyfit.callbacks.history import History
from easyfit.callbacks.progress import progress_callbacks
from easyfit.data.batches import batch_count, batch_source, make_batches, split_validation
from easyfit.data.model_targets import targets_in_forward
from easyfit.data.steps import limit_steps
from easyfit.data.weights import validation_weight, weigh_batches
from easyfit.distributed import fault_tolerance
from easyfit.distributed.from_rank_zero import callback_attributes, recorded_warnings
from easyfit.distributed.run_options import RunOptions
from easyfit.distributed.strategies.states import Fit
from easyfit.distributed.unused_parameters import explain_unused_parameters
from easyfit.parts.lr_scaling import StepRates, describe, effective_batch, lr_multiplier, track_optimizer_steps
from easyfit.saving.resume import EpochPosition
from easyfit.training.call_kind import CallKind
from easyfit.training.first_batch import prepare, prepare_fit_data
from easyfit.training.fit_options import FitOptions, TrainingSettings
from easyfit.training.loop import Loop
from easyfit.training.plan import LoopOptions, Plan, check_fit_call, check_loop_call
from easyfit.training.running_call import RunningCall


def call_on_rank(plan: Plan, model, **inputs) -> tuple[Any, dict | None]:
    """What every rank runs for a call: its kind's body, `plan.kind.on_rank(model, run options, **inputs)`, under the
    plan's strategy and the call's `RunningCall` on the Model (dropped at the end, the outer call's put back); (its
    result, the state rank 0 hands back to a caller in another process, or None)."""
    strategy, kind, outer = plan.strategy, plan.kind, model.running
    call_state = strategy.setup_environment(plan.launched)
    # a rank-local call (strategy="single" among ranks) keeps the rank's identity
    identity = (strategy.global_rank, strategy.world_size) if strategy.world_size > 1 else None
    model.running = call = RunningCall(strategy, strategy.precision_plugin(model.precision, plan.precision),
                                       identity or (outer or model._last_call).identity, call_state)
    returns_state = plan.rank_zero_elsewhere and strategy.is_global_zero
    say = print if kind.trains and inputs["options"].verbose and strategy.is_global_zero else None
    try:
        with recorded_warnings(returns_state) as caught, model.compiled_steps.running(plan.compiling, strategy, say):
            result = kind.on_rank(model, plan.run, **inputs)
        if not returns_state:
            return result, None
        returned = {"warnings": caught, "input_example": model._input_example}   # what model.export traces with
        if not kind.trains:
            return result, returned
        # a History refers to the whole Model: the caller rebuilds its own from the state instead
        return None, {**model.checkpoint_state(), **returned,
                      "callback_attributes": callback_attributes(inputs["options"].callbacks)}
    except RuntimeError as error:   # DDP's unused-parameter error, with the parameters' names and the fix
        explained = explain_unused_parameters(error, model.net)
        if explained is None:
            raise
        raise explained from error
    finally:
        strategy.teardown(call_state)
        model._last_call, model.running = model._last_call.after(call), outer


def fit_on_rank(model, run: RunOptions, x, y, options: FitOptions) -> History:
    """Train `model` on (x, y) under its strategy; every rank ends with the trained state (the fit's `end`)."""
    call = model.running
    strategy, precision = call.strategy, call.precision
    validation_data, val_weight = validation_weight(options.validation_data)   # (x, y, w) -> (x, y), w
    if options.validation_split:   # with validation_data too is refused by the plan
        (x, y), validation_data = split_validation(x, y, options.validation_split, precision.float_dtype)
    loss_fn = weighted_loss = model.loss_fn
    train = call_batches(model, run, x, y, options.batch_size, train=True, shuffle=options.shuffle, seed=options.seed)
    val = None
    if validation_data is not None:
        val = call_batches(model, run, *_as_pair(validation_data), options.validation_batch_size or options.batch_size)
    if options.sample_weight is not None or options.class_weight is not None or val_weight is not None:
        train, val, weighted_loss = weigh_batches(loss_fn, train, val, options.sample_weight,
                                                  options.class_weight, val_weight, bool(options.validation_split))
    train = limit_steps(train, options.steps_per_epoch, "training")
    val = None if val is None else limit_steps(val, options.validation_steps, "validation")
    precision.convert_module(model.net)
    settings = TrainingSettings.of(options, scheduler_interval=model.scheduler_interval, precision=precision.name)
    user_optimizer = model.optimizer
    fit = strategy.setup(model.net, user_optimizer, model.scheduler, settings=settings, call=call.call_state)
    if not isinstance(fit, Fit):
        raise TypeError(f"{type(strategy).__qualname__}.setup returned {type(fit).__name__}, not the fit's object: "
                        "setup now returns an easyfit.strategies.Fit (Fit(strategy=self, net=..., optimizer=..., "
                        "scheduler=...), or a subclass holding what the backend keeps); see docs/strategies.md")
    track_optimizer_steps(fit.scheduler)
    # until the fit ends, Model and the callbacks use the fit's objects, and this fit's loss (weighted when weights
    # were given)
    call.training, call.loss_fn, call.train_batches = fit, weighted_loss, train
    try:
        train_epochs(model, options, train, val, settings, fit)
    except BaseException:
        fit.abandon()
        raise
    finally:
        call.training = call.loss_fn = call.train_batches = None
    fit.end(model.net, user_optimizer)   # every rank, on success
    return model.history


def train_epochs(model, options: FitOptions, train, val, settings: TrainingSettings, fit: Fit) -> None:
    """The epochs of a fit, with LR scaling, a resumed or fault-tolerance checkpoint, warmup and the callbacks."""
    call, optimizer = model.running, fit.optimizer
    strategy = call.strategy
    multiplier = call.lr_multiplier = lr_multiplier(options.lr_scaling, strategy.batch_factor)
    rates = StepRates(optimizer, 1.0)
    try:
        model.history = History()
        params = fit_params(model, options, fit, multiplier, batch_count(train),
                            getattr(getattr(batch_source(train), "loader", None), "batch_size", None))
        initial_epoch = options.initial_epoch
        restarts = options.max_restarts if call.call_state.launched.by_easyfit else 0   # easyfit's launch restarts
        restartable = fault_tolerance.restartable_fit(options.fault_tolerance, restarts, strategy)
        callbacks = call.callbacks = fit_callbacks(model, options, strategy.is_global_zero, params, restartable)
        resume_from = ((restartable and restartable.resume_from) or backup_to_resume(options.callbacks)
                       or options.resume_from)
        state = None if resume_from is None else fit.load_checkpoint(resume_from)
        if state is not None:
            model.restore(state, training=True)
            model.history.set_params(params)   # this fit's settings, not those of the fit that saved
            initial_epoch = model.completed_epochs
        if restartable is not None:   # says a resume in the summary line, or writes the restartable's first checkpoint
            fault_tolerance.begin(model, restartable, state, options, params, initial_epoch)
        elif state is not None:
            params["summary"] += model.position.metrics_note(initial_epoch, "resume")
        rates = step_rates(options, train, optimizer, multiplier, initial_epoch, model.position)
        if options.verbose and strategy.is_global_zero:
            print(params["summary"])
        call.stop_training = False
        # after a resume: a bad checkpoint runs no forward
        first_steps = prepare_fit_data(model, fit, train, val)
        with exceptions_told(callbacks):
            Loop(model, callbacks, fit, settings, rates, first_steps).fit(
                train, val, options.epochs, initial_epoch, options.validation_freq)
    finally:   # a step that raised leaves the schedule's rates too
        rates.release()
        call.lr_multiplier = 1.0


def fit_callbacks(model, options: FitOptions, is_global_zero: bool, params: dict | None = None,
                  restartable: fault_tolerance.RestartableFit | None = None) -> CallbackList:
    """The History, the progress display, the user's callbacks and the fault-tolerance checkpoint of a fit: the
    fit's callbacks, whose states its checkpoints hold (in a rank, and in the caller of spawned ranks, which gives
    them rank 0's states)."""
    display = progress_callbacks(options.verbose, is_global_zero)
    tolerance = [] if restartable is None else [fault_tolerance.FaultToleranceCheckpoint(
        restartable, options.fault_tolerance_every_n_steps, options.gradient_accumulation_steps)]
    return CallbackList([model.history, *display, *options.callbacks, *tolerance], model, params or {})


def step_rates(options: FitOptions, train, optimizer, multiplier: float, initial_epoch: int,
               position: EpochPosition) -> StepRates:
    """The scale of each optimizer step's LR, with the ramp of the first `lr_warmup_epochs` epochs; a resumed fit
    continues the ramp where it stood."""
    if not options.lr_warmup_epochs:
        return StepRates(optimizer, multiplier)
    num_batches = batch_count(train)
    if num_batches is None:
        raise ValueError("lr_warmup_epochs needs data whose number of batches is known (len()); "
                         "this data has no length")
    accumulate = options.gradient_accumulation_steps
    steps_per_epoch = -(-num_batches // accumulate)   # a short last window steps too
    return StepRates(optimizer, multiplier, options.lr_warmup_epochs * steps_per_epoch,
                     steps_done=initial_epoch * steps_per_epoch + position.batches_done // accumulate)


def fit_params(model, options: FitOptions, fit: Fit, multiplier: float, steps_per_epoch: int | None,
               batch_size: int | None = None) -> dict:
    """The fit's params for the callbacks (Keras' `self.params`); `batch_size`: the per-process batch of the data
    when it says (a DataLoader used as given), else fit's."""
    strategy, batch_size = fit.strategy, batch_size or options.batch_size
    factor = strategy.batch_factor
    return {
        "epochs": options.epochs, "batch_size": batch_size, "verbose": options.verbose,
        "validation_freq": options.validation_freq,
        "validation": options.validation_data is not None or bool(options.validation_split),
        "world_size": strategy.world_size, "batch_factor": factor,
        "effective_batch_size": effective_batch(batch_size, factor, options.gradient_accumulation_steps),
        "steps_per_epoch": steps_per_epoch, "gradient_accumulation_steps": options.gradient_accumulation_steps,
        "lr_scaling": options.lr_scaling if multiplier != 1.0 else None, "lr_multiplier": multiplier,
        "strategy": strategy.name, "precision": model.running.precision.name,
        "summary": describe(batch_size, strategy, options.lr_scaling, fit.optimizer, multiplier,
                            options.gradient_accumulation_steps, fit),
    }


def eval_loop(model, verbose: int, callbacks: list[Callback]) -> Loop:
    call = model.running
    call.precision.convert_module(model.net)
    display = progress_callbacks(verbose, call.strategy.is_global_zero)
    callback_list = CallbackList([*display, *callbacks], model, {"verbose": verbose})
    return Loop(model, callback_list, Fit(strategy=call.strategy, net=model.net, call=call.call_state))


def call_batches(model, run: RunOptions, x, y, batch_size: int, train: bool = False, targets: bool = True, **options):
    """The batches of a call (`make_batches` with the run's options); with `targets`, the net's own loss
    (loss="model") gets its targets in the forward."""
    call = model.running
    batches = make_batches(x, y, batch_size=batch_size, strategy=call.strategy, train=train,
                           num_workers=run.num_workers, replace_sampler=run.replace_sampler,
                           float_dtype=call.precision.float_dtype, collate_fn=run.collate_fn, **options)
    return targets_in_forward(batches, model.net, model.loss_fn) if targets else batches


def evaluate_on_rank(model, run: RunOptions, x, y, options: LoopOptions) -> dict:
    batches = call_batches(model, run, x, y, options.batch_size)
    loop = eval_loop(model, options.verbose, options.callbacks)
    loop.first_steps[batches] = prepare(model, loop.training.module_for_eval(), batches, "the evaluation data")
    with exceptions_told(loop.callbacks):
        return loop.evaluate(batches)


def predict_on_rank(model, run: RunOptions, x, y, options: LoopOptions):
    strategy = model.running.strategy
    batches = call_batches(model, run, x, y, options.batch_size, targets=False, inputs_only=True)
    loop = eval_loop(model, options.verbose, options.callbacks)
    loop.first_steps[batches] = prepare(model, loop.training.module_for_eval(), batches, "the data", targets=False)
    with exceptions_told(loop.callbacks):
        outputs = loop.predict(batches)
    tensors = all(isinstance(output, torch.Tensor) for output in outputs)
    if strategy.world_size == 1 or not batches.sharded:
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


FIT = CallKind("fit", fit_on_rank, check_fit_call, trains=True)
EVALUATE = CallKind("evaluate", evaluate_on_rank, check_loop_call)
PREDICT = CallKind("predict", predict_on_rank, check_loop_call)
