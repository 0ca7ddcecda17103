"""DeepSpeed ZeRO stages 1-3, with optional CPU offload of the optimizer (stages 2, 3) and parameters (stage 3).

The DeepSpeed engine owns the step: it scales the loss for accumulation, reduces and partitions gradients, clips,
steps the optimizer and zeroes the gradients. The user's optimizer is rebuilt over a copy of the net and handed to
the engine as its client optimizer, so no C++ optimizer op has to compile (a "optimizer" section in the user's config
asks DeepSpeed for its own instead). Nor does DeepSpeed's shared-memory all-reduce for CPUs, which only its inference
layers call: training's collectives go through torch.distributed (see `deepspeed_for_training`).

Checkpoints hold the full fp32 weights and the optimizer state in the plain optimizer's format (gathered from every
rank), or, with `state_dict_type="sharded"`, DeepSpeed's own directory.

At stage 3, `module_construction()` is `deepspeed.zero.Init`: each parameter is partitioned as its module is built,
and the engine trains the user's net itself (zero_init makes it a plain module again at the end of fit).
"""
from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, replace

import torch

from easyfit.distributed.strategies.base import whole_tensors
from easyfit.distributed.strategies.capabilities import Capabilities
from easyfit.distributed.strategies.sharded import FULL, SHARDED, ShardedFit, ShardingStrategy
from easyfit.distributed.strategies.states import NOT_LAUNCHED, Launched
from easyfit.distributed.strategy_parts import zero_init
from easyfit.distributed.strategy_parts.construction import ZERO3, built_sharded, join_ranks
from easyfit.distributed.strategy_parts.deepspeed_config import DeepSpeedConfig, read_config
from easyfit.distributed.strategy_parts.deepspeed_state import FullState
from easyfit.distributed.strategy_parts.sharding import (
    copy_to_train,
    load_on_device,
    optimizer_params,
    param_names,
    plain_on_device,
    require,
    without_weights,
)
from easyfit.parts.precision import Precision, cpu_supports_fp16
from easyfit.saving.backend_folders import check_deepspeed_folder
from easyfit.saving.checkpoint import DEEPSPEED_CLIENT_KEY, FORMAT_KEY, FORMAT_VERSION, as_data
from easyfit.utils.deepspeed_import import autotuner_tracker_hidden
from easyfit.utils.tensors import map_tensors


def deepspeed_for_training(strategy: str):
    """The deepspeed package (imported without the tracker its autotuner loads: `autotuner_tracker_hidden`), told
    not to build its shared-memory all-reduce op for CPUs (`ShareMemCommBuilder`), for
    `setup_environment` to start DeepSpeed's communication backend with (every other use comes after it).
    DeepSpeed compiles that C++ op as its communication backend starts, 30-60 s on a machine's first fit, and only its
    inference all-reduce calls it, falling back to torch.distributed's all-reduce without it; training never does."""
    with autotuner_tracker_hidden():
        deepspeed = require("deepspeed", "deepspeed", strategy)
    from deepspeed.accelerator import get_accelerator
    builder = get_accelerator().create_op_builder("ShareMemCommBuilder")   # None where the accelerator has no such op
    if builder is not None:
        deepspeed.ops.__compatible_ops__[builder.NAME] = False   # the table of ops DeepSpeed may build
    return deepspeed


class DeepSpeedPrecision(Precision):
    """Mixed precision as DeepSpeed does it: the engine holds the net in fp16 / bf16 (with fp32 master weights in
    the optimizer) and casts its floating inputs to that dtype (`cast_inputs`); there is no autocast. Batches stay
    fp32, so the fp32 net that validation and the first-batch check run takes them as they are."""

    casts_inputs = True

    def autocast(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()


def cast_inputs(module: torch.nn.Module, dtype: torch.dtype) -> None:
    """Cast the floating tensors among `module`'s forward arguments to `dtype`, on every call."""
    def cast(value):
        return map_tensors(lambda tensor: tensor.to(dtype) if tensor.is_floating_point() else tensor, value)
    module.register_forward_pre_hook(lambda _, args, kwargs: (cast(args), cast(kwargs)), with_kwargs=True)


@dataclass(kw_only=True)
class DeepSpeedFit(ShardedFit):
    """A DeepSpeed fit: its net is the engine, its optimizer the one the engine steps; the user's net and its
    parameter names, the engine's state in full, plain form, the plain modules of a net built under
    module_construction() (None for a copy), the summary line's note on the buckets, and whether the coming backward
    is an accumulation micro-step."""

    user_net: torch.nn.Module
    names: list[str]
    full_state: FullState
    layout: zero_init.Layout | None
    sizing_note: str
    accumulating: bool = False


class DeepSpeedStrategy(ShardingStrategy):
    """strategy="deepspeed" (ZeRO stage 2) and the "deepspeed_stage_*" names; `easyfit.strategies.DeepSpeed`.

    Args:
        stage: the ZeRO stage: 1 shards optimizer state, 2 also gradients, 3 also parameters.
        offload_optimizer: keep optimizer state (and the step) in CPU memory (stages 2 and 3).
        offload_parameters: keep parameters in CPU memory between uses (stage 3).
        allgather_bucket_size, reduce_bucket_size: communication bucket sizes, in elements.
        config: a DeepSpeed config (dict or JSON path; default: the EASYFIT_DEEPSPEED_CONFIG variable). Every key
            set there wins over what easyfit derives from fit's arguments.
        state_dict_type, hand_back: see ShardingStrategy; a "sharded" checkpoint is DeepSpeed's checkpoint
            directory, every rank writing its partition.
    """

    # the engine builds the step (not compiled by fit(compile=...)): it accumulates, clips and steps itself
    capabilities = Capabilities(handles_accumulation=True, handles_clipping=True, plain_optimizer_step=False)
    STATE_FORMATS = (FULL, SHARDED)

    def __init__(self, stage: int = 2, offload_optimizer: bool = False, offload_parameters: bool = False,
                 allgather_bucket_size: float | None = None, reduce_bucket_size: float | None = None,
                 config: str | os.PathLike | dict | None = None, **kwargs):
        super().__init__(**kwargs)
        if stage not in (1, 2, 3):
            raise ValueError(f"stage must be 1, 2 or 3, got {stage!r}")
        if offload_parameters and stage != 3:
            raise ValueError("offload_parameters needs stage=3 (only stage 3 partitions parameters)")
        if stage == 3:   # stage 3 partitions parameters, and can build a net partitioned from the start
            self.capabilities = replace(self.capabilities, shards_parameters=True, trains_built_sharded=ZERO3)
        self.stage, self.offload_optimizer, self.offload_parameters = stage, offload_optimizer, offload_parameters
        self.buckets = {"allgather_bucket_size": allgather_bucket_size, "reduce_bucket_size": reduce_bucket_size}
        self.user_config = read_config(config)
        self.name = "deepspeed"

    # --- configuration --------------------------------------------------------------
    def config(self, settings=None, num_params: int | None = None) -> dict:
        """The config handed to DeepSpeed: defaults derived from a fit's `settings` (its TrainingSettings; and, given
        the number of parameters trained, bucket sizes fitted to the net), then the user's keys over them."""
        return self._config_builder().training(settings, num_params)

    def construction_config(self) -> dict:
        """The config `zero.Init` partitions with, before any fit."""
        return self._config_builder().construction()

    def _config_builder(self) -> DeepSpeedConfig:
        return DeepSpeedConfig(self.stage, self.offload_optimizer, self.offload_parameters, self.buckets,
                               self.user_config, pin_memory=self.accelerator == "cuda")

    def describe_setup(self, fit=None) -> str | None:
        return fit.sizing_note if isinstance(fit, DeepSpeedFit) else None

    def check_precision(self, precision: str) -> None:
        if precision == "64":
            raise ValueError("DeepSpeed trains in precision '32', '16-mixed' or 'bf16-mixed', not '64'")
        if precision == "16-mixed" and self.accelerator == "cpu" and not cpu_supports_fp16():
            raise ValueError("DeepSpeed cannot train in precision='16-mixed' on this CPU: it has no float16 "
                             "kernels (no AVX512-FP16 / AMX-FP16). Use precision='bf16-mixed' with DeepSpeed, or "
                             "strategy='fsdp' (torch's autocast runs float16 on any CPU).")

    def precision_plugin(self, current: Precision, requested) -> Precision:
        plugin = super().precision_plugin(current, requested)
        return plugin if isinstance(plugin, DeepSpeedPrecision) else DeepSpeedPrecision(plugin.name, plugin.device)

    # --- life -----------------------------------------------------------------------
    def module_construction(self) -> contextlib.AbstractContextManager:
        """Stage 3: `deepspeed.zero.Init`, each parameter partitioned over the ranks as its module is built (the
        ranks meet here). Stages 1 and 2 keep full parameters in every process: the net is built as usual."""
        if self.stage != 3:
            return contextlib.nullcontext()
        join_ranks(self)   # setup_environment(): DeepSpeed's communication backend starts there
        deepspeed = require("deepspeed", "deepspeed", self.name)
        return deepspeed.zero.Init(config_dict_or_path=self.construction_config())

    def setup_environment(self, launched: Launched = NOT_LAUNCHED):
        call = super().setup_environment(launched)
        # DeepSpeed reads the ranks from the variables its own launcher and torchrun set; easyfit's rank 0 has none
        for variable, value in (("LOCAL_RANK", self.local_rank), ("RANK", self.global_rank),
                                ("WORLD_SIZE", self.world_size)):
            os.environ.setdefault(variable, str(value))
        deepspeed_for_training(self.name).init_distributed(dist_backend=self.process_group_backend)
        return call

    def setup(self, net: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler=None, settings=None,
              call=None) -> DeepSpeedFit:
        deepspeed = require("deepspeed", "deepspeed", self.name)
        num_params = sum(getattr(p, "ds_numel", p.numel()) for p in optimizer_params(optimizer))   # ZeRO-3: full sizes
        config = self.config(settings, num_params)
        sizing_note = DeepSpeedConfig.describe(config)
        built = built_sharded(net) == ZERO3   # under module_construction(): the engine trains the user's net
        trained = net if built else copy_to_train(net, optimizer, self.root_device)
        layout = zero_init.layout(net) if built else None
        names, own = param_names(net, optimizer), dict(trained.named_parameters())
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}
        low = next((dtype[key] for key in dtype if config.get(key, {}).get("enabled")), None)
        if built and low is not None:   # built in fp32: its partitions take the dtype the engine computes in
            zero_init.cast_partitions(net, low)
        # a config that names an optimizer has DeepSpeed build it
        client = None if "optimizer" in config else self.rebuilt_optimizer(optimizer, net, trained)
        engine, _, _, _ = deepspeed.initialize(model=trained, optimizer=client, config=config,
                                               dist_init_required=False)
        stepping = client if client is not None else engine.basic_optimizer
        if low is not None:
            cast_inputs(engine.module, low)
        full_state = FullState(engine, [own[name] for name in names],
                               [len(group["params"]) for group in optimizer.param_groups], self)
        fit = DeepSpeedFit(strategy=self, net=engine, optimizer=stepping, scheduler=scheduler, call=call, user_net=net,
                           names=names, full_state=full_state, layout=layout, sizing_note=sizing_note)
        return self.take_over_optimizer(fit, optimizer)

    def trains_sharded(self, fit) -> bool:
        return isinstance(fit, DeepSpeedFit)

    def full_optimizer_state(self, fit: DeepSpeedFit) -> dict:
        return fit.full_state.optimizer_state(fit.optimizer)

    def hand_back_weights(self, fit: DeepSpeedFit, user_net, user_optimizer) -> None:
        full = fit.full_state.module_state()
        if fit.layout is not None:   # the user's net is the engine's: made plain with the full weights
            self._release_built_net(fit, user_net, user_optimizer, full)
        else:
            load_on_device(user_net, full, self.root_device)

    def _release_built_net(self, fit: DeepSpeedFit, user_net, user_optimizer, full: dict) -> None:
        """The engine lets go of the net built under module_construction(), which becomes a plain module holding
        the full weights; the user's optimizer follows its new parameters."""
        fresh = zero_init.fresh_parameters(user_net, full, self.root_device)
        fit.net.destroy()   # the engine's hooks off the modules
        zero_init.make_plain(user_net, fit.layout, fresh)
        zero_init.repoint_optimizer(user_optimizer, fresh)

    def gathered_copy(self, fit: DeepSpeedFit) -> torch.nn.Module:
        """From the user's net, or from the layout of a net built under module_construction() (the engine's own)."""
        full = fit.full_state.module_state()
        if fit.layout is None:
            return plain_on_device(fit.user_net, full, self.root_device)
        return zero_init.plain_copy(fit.user_net, fit.layout, full, self.root_device)

    # --- the step -------------------------------------------------------------------
    @contextlib.contextmanager
    def no_sync(self, fit: DeepSpeedFit):
        """An accumulation micro-step: the engine is told it is not at a boundary (it reduces and steps at the
        boundary the loop chose, also for a short last window)."""
        fit.accumulating = True
        try:
            yield
        finally:
            fit.accumulating = False

    def backward(self, fit: DeepSpeedFit, loss: torch.Tensor, precision: Precision) -> None:
        fit.net.set_gradient_accumulation_boundary(not fit.accumulating)
        fit.net.backward(loss)

    def optimizer_step(self, fit: DeepSpeedFit, precision: Precision) -> None:
        fit.net.step()

    def zero_grad(self, fit: DeepSpeedFit) -> None:
        """The engine zeroes gradients after each of its steps."""

    # --- state ----------------------------------------------------------------------
    def module_state(self, fit) -> dict:
        if not isinstance(fit, DeepSpeedFit):
            return super().module_state(fit)
        return {} if self.state_dict_type == SHARDED else fit.full_state.module_state()

    def local_tensors(self, fit, buffers: bool = False) -> list[torch.Tensor]:
        """The fp32 weights the engine's optimizer steps (which its state and evaluation copy are read from), this
        rank's part of each parameter: its ZeRO-3 partition, or under stages 1 and 2 its fragment of the flat
        partition (an empty view where this rank holds none of it)."""
        if not isinstance(fit, DeepSpeedFit):
            return super().local_tensors(fit, buffers)
        own = [_local_fp32(param) for param in fit.net.module.parameters()]
        return own + whole_tensors(fit.net.module, buffers)[len(own):]

    def load_module_state(self, fit, state: dict) -> None:
        if not isinstance(fit, DeepSpeedFit):
            return super().load_module_state(fit, state)
        if state:   # else a sharded checkpoint: the engine loaded its partitions itself
            fit.full_state.load_module_state(state)

    def optimizer_state(self, fit) -> dict:
        if not isinstance(fit, DeepSpeedFit):
            return super().optimizer_state(fit)
        return {} if self.state_dict_type == SHARDED else fit.full_state.optimizer_state(fit.optimizer)

    def load_optimizer_state(self, fit, state: dict) -> None:
        if not isinstance(fit, DeepSpeedFit):
            return super().load_optimizer_state(fit, state)
        if state:   # else a sharded checkpoint: the engine loaded its partitions itself
            fit.full_state.load_optimizer_state(fit.optimizer, state)

    # --- checkpoints ----------------------------------------------------------------
    def save_shards(self, fit: DeepSpeedFit, path: str, state: dict) -> None:
        """DeepSpeed's directory (each rank its partitions), with the rest of the state in its client state."""
        rest = without_weights(state)
        # what easyfit.saving.convert needs to write the optimizer state in the plain optimizer's form
        rest.update(param_names=fit.names, param_groups=fit.full_state.plain_groups(fit.optimizer))
        fit.net.save_checkpoint(path, tag="checkpoint",
                                   client_state={DEEPSPEED_CLIENT_KEY: as_data({FORMAT_KEY: FORMAT_VERSION, **rest})})

    def sharded_folder(self) -> tuple[str, str]:
        return "DeepSpeed", "a DeepSpeed strategy on as many processes as wrote it"

    def load_shards(self, fit: DeepSpeedFit, path: str) -> dict:
        check_deepspeed_folder(os.path.join(path, "checkpoint"))   # DeepSpeed unpickles: checked as data first
        _, client_state = fit.net.load_checkpoint(path, tag="checkpoint", load_module_strict=True,
                                                     load_optimizer_states=True, load_lr_scheduler_states=False)
        rest = {key: value for key, value in client_state[DEEPSPEED_CLIENT_KEY].items()
                if key not in ("param_names", "param_groups")}
        return {**rest, "net": {}, "optimizer": {}}


def _local_fp32(param: torch.nn.Parameter) -> torch.Tensor:
    """This rank's part of the fp32 master copy of `param` (a view the optimizer steps)."""
    if hasattr(param, "ds_id"):
        from deepspeed.utils import safe_get_local_fp32_param
        return safe_get_local_fp32_param(param).detach()
    mapping = getattr(param, "_hp_mapping", None)
    return mapping.get_hp_fragment().detach() if mapping is not None else param.detach().flatten()[:0]
