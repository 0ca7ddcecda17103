"""PyTorch FSDP2 (`torch.distributed.fsdp.fully_shard`): parameters, gradients and optimizer state sharded over the
ranks. Each parameter becomes a DTensor holding this rank's slice; the user's optimizer is rebuilt over them.

The user's net is not sharded in place: a copy is, and at the end of fit the full trained weights are loaded back
into the user's net (`hand_back`), which evaluate, predict and `model.save` then use. A net built under
`module_construction()` is on the meta device: its copy is materialized and sharded one unit at a time (meta_init).
"""
from __future__ import annotations

import contextlib
import copy
import os

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor

from easyfit.distributed.strategies.ddp import DDPStrategy
from easyfit.distributed.strategy_parts import sharding
from easyfit.distributed.strategy_parts.construction import META, built_sharded
from easyfit.distributed.strategy_parts.meta_init import (
    check_initializable,
    construction_rng,
    materialize,
    materialize_sharded,
    on_meta_device,
    uninitializable,
)
from easyfit.distributed.strategy_parts.sharding import (
    directory_outside_fit,
    move_scheduler,
    optimizer_params,
    param_names,
    rebuild_optimizer,
    without_weights,
)
from easyfit.parts.precision import Precision
from easyfit.saving.backend_folders import check_dcp_folder
from easyfit.saving.checkpoint import FSDP_META_FILE, load_checkpoint_file, save_checkpoint_file

CONTAINERS = (torch.nn.Sequential, torch.nn.ModuleList, torch.nn.ModuleDict)
STATE_FORMATS = ("full", "sharded")


class PolicyPrecision(Precision):
    """Mixed precision expressed by FSDP2's MixedPrecisionPolicy (it casts parameters and inputs): no autocast."""

    def autocast(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()


def full_tensor(value):
    """A DTensor gathered into one ordinary tensor on the CPU (a collective); other values as they are."""
    return value.full_tensor().cpu() if isinstance(value, DTensor) else value


def shard_like(value, reference):
    """`value` (a full tensor every rank holds) cut into `reference`'s DTensor layout, without communication."""
    if not isinstance(reference, DTensor) or not isinstance(value, torch.Tensor) or isinstance(value, DTensor) \
            or value.shape != reference.shape:
        return value
    local = value.to(device=reference.device, dtype=reference.dtype)
    return distribute_tensor(local, reference.device_mesh, reference.placements, src_data_rank=None)


def shard_units(net: torch.nn.Module) -> list[torch.nn.Module]:
    """The submodules each sharded (and gathered) as one unit: every module with parameters that is a direct child
    of the net or of a container in it (Sequential, ModuleList, ModuleDict)."""
    units = []

    def visit(module: torch.nn.Module) -> None:
        for child in module.children():
            if isinstance(child, CONTAINERS):
                visit(child)
            elif any(True for _ in child.parameters()):
                units.append(child)
    visit(net)
    return units


#: DDPStrategy's options for its gradient all-reduce, which FSDP does not run
DDP_COMMUNICATION = ("comm_hook", "powersgd_rank", "powersgd_start_step", "model_averaging_period",
                     "model_averaging_warmup")


class FSDPStrategy(DDPStrategy):
    """strategy="fsdp" / "fsdp_cpu_offload".

    Args:
        cpu_offload: keep the sharded parameters, gradients and optimizer state in CPU memory between uses.
        state_dict_type: "full" (checkpoints are one consolidated file) or "sharded" (a torch.distributed.checkpoint
            directory each rank writes its shard to; for nets too big to gather on one rank).
        hand_back: put the full trained weights into the user's net at the end of fit (False for nets too big to
            gather on one rank: save a sharded checkpoint instead).
    """

    supports_compile = False   # its engine / wrapper builds the step: not compiled by fit(compile=...)

    def __init__(self, *args, cpu_offload: bool = False, state_dict_type: str = "full", hand_back: bool = True,
                 **kwargs):
        ignored = [name for name in DDP_COMMUNICATION if name in kwargs]
        if ignored:
            raise ValueError(f"FSDPStrategy does not take {', '.join(ignored)}: DDP's gradient communication "
                             "options, which FSDP (it reduce-scatters the sharded gradients itself) would ignore; use "
                             "DDPStrategy for compressed gradients or local SGD")
        super().__init__(*args, **kwargs)
        if state_dict_type not in STATE_FORMATS:
            raise ValueError(f"state_dict_type must be one of {', '.join(STATE_FORMATS)}, got {state_dict_type!r}")
        self.cpu_offload, self.state_dict_type, self.gather_at_end = cpu_offload, state_dict_type, hand_back
        self.name = "fsdp_cpu_offload" if cpu_offload else "fsdp"
        self._precision_name = "32"
        self._scheduler = self._user_net = self._sharded = self._optimizer = None
        self._names: list[str] = []

    # --- precision ------------------------------------------------------------------
    def precision_plugin(self, current: Precision, requested) -> Precision:
        plugin = super().precision_plugin(current, requested)
        if plugin.autocast_dtype is None or isinstance(plugin, PolicyPrecision):
            return plugin
        policy = PolicyPrecision(plugin.name, plugin.device)
        policy.load_state_dict(plugin.state_dict())
        return policy

    def configure_training(self, settings) -> None:
        self._precision_name = settings.precision

    def _mixed_precision(self) -> MixedPrecisionPolicy:
        dtype = {"16-mixed": torch.float16, "bf16-mixed": torch.bfloat16}.get(self._precision_name)
        return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32 if dtype else None,
                                    output_dtype=torch.float32 if dtype else None)

    # --- life -----------------------------------------------------------------------
    trains_built_sharded = META

    def module_construction(self) -> contextlib.AbstractContextManager:
        """Modules built in this context are on the meta device (no memory); `setup` materializes the net one shard
        unit at a time, with the weights it would have had if built whole. It needs no ranks yet."""
        return on_meta_device()

    def setup(self, net: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler=None):
        on_meta = built_sharded(net) == META
        if on_meta:
            check_initializable(uninitializable(net))
        sharded = copy.deepcopy(net) if on_meta else sharding.copy_to_train(net, optimizer, self.root_device)
        mesh = init_device_mesh(self.root_device.type, (self.world_size,))
        options = {"mesh": mesh, "mp_policy": self._mixed_precision()}
        if self.cpu_offload:
            options["offload_policy"] = CPUOffloadPolicy(pin_memory=self.root_device.type == "cuda")
        if on_meta:   # every rank initializes from rank 0's RNG state, as the net built whole there
            materialize_sharded(sharded, shard_units(sharded), lambda unit: fully_shard(unit, **options),
                                self.broadcast(construction_rng(net)))
        else:
            for unit in shard_units(sharded):
                fully_shard(unit, **options)
            fully_shard(sharded, **options)
        new_params = dict(sharded.named_parameters())
        names = dict(zip(map(id, optimizer_params(optimizer)), param_names(net, optimizer)))
        rebuilt = rebuild_optimizer(optimizer, lambda p: new_params[names[id(p)]])
        if optimizer.state:   # a resumed or second fit continues from the user's optimizer state
            self.load_optimizer_state(rebuilt, optimizer.state_dict())
        move_scheduler(scheduler, rebuilt)
        self._scheduler, self._user_net, self._sharded, self._optimizer = scheduler, net, sharded, rebuilt
        self._names = param_names(net, optimizer)
        return sharded, rebuilt, scheduler

    def hand_back(self, user_net, user_optimizer, net, optimizer) -> None:
        move_scheduler(self._scheduler, user_optimizer)
        if self.gather_at_end:
            if built_sharded(user_net) == META:   # built under module_construction(): materialized on the CPU
                materialize(user_net)
                user_net.load_state_dict(self._full_module_state(net))
            else:
                sharding.hand_back_weights(user_net, self._full_module_state(net), self.root_device)
            user_optimizer.load_state_dict(self._full_optimizer_state(optimizer))

    def forward_in_lockstep(self, net: torch.nn.Module) -> bool:
        """With hand_back=False (a net too big to gather) nothing is ever gathered: the first-batch check and
        validation run the sharded net, every rank in step."""
        return isinstance(net, FSDPModule) and not self.gather_at_end

    def module_for_eval(self, net: torch.nn.Module) -> torch.nn.Module:
        """Validation inside fit runs a plain copy of the user's net with the gathered weights, made for the pass:
        ranks may get different numbers of evaluation batches, and a sharded forward would wait for the others at
        every layer. (A net built on the meta device stays there until the fit hands the weights back: the copy is
        materialized.) With hand_back=False the sharded net itself runs (`forward_in_lockstep`)."""
        if self.forward_in_lockstep(net):
            return net
        if not isinstance(net, FSDPModule):
            return super().module_for_eval(net)
        source = self._user_net
        if built_sharded(source) == META:
            source = copy.deepcopy(source)
            materialize(source)
        return sharding.plain_on_device(source, self._full_module_state(net), self.root_device)

    # --- state ----------------------------------------------------------------------
    def module_state(self, net: torch.nn.Module) -> dict:
        if not isinstance(net, FSDPModule):
            return super().module_state(net)
        return net.state_dict() if self.state_dict_type == "sharded" else self._full_module_state(net)

    @staticmethod
    def _full_module_state(net: torch.nn.Module) -> dict:
        return {key: full_tensor(value) for key, value in net.state_dict().items()}

    def local_tensors(self, net: torch.nn.Module, buffers: bool = False) -> list[torch.Tensor]:
        """Each parameter's shard on this rank (its DTensor's local tensor); buffers are whole on every rank."""
        return [tensor.to_local() if isinstance(tensor, DTensor) else tensor
                for tensor in super().local_tensors(net, buffers)]

    def load_module_state(self, net: torch.nn.Module, state: dict) -> None:
        if not isinstance(net, FSDPModule):
            return super().load_module_state(net, state)
        own = net.state_dict()
        net.load_state_dict({key: shard_like(value, own[key]) for key, value in state.items()})

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict:
        if self.state_dict_type == "sharded":   # keyed by parameter name, each rank its slices
            from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
            return get_optimizer_state_dict(self._sharded, optimizer)
        return self._full_optimizer_state(optimizer)

    @staticmethod
    def _full_optimizer_state(optimizer: torch.optim.Optimizer) -> dict:
        state = optimizer.state_dict()
        return {**state, "state": {index: {key: full_tensor(value) for key, value in entry.items()}
                                   for index, entry in state["state"].items()}}

    def load_optimizer_state(self, optimizer: torch.optim.Optimizer, state: dict) -> None:
        if any(isinstance(key, str) for key in state["state"]):   # the sharded, name-keyed form
            from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict
            return set_optimizer_state_dict(self._sharded, optimizer, state)
        params = optimizer_params(optimizer)
        entries = {index: {key: shard_like(value, params[index]) for key, value in entry.items()}
                   for index, entry in state["state"].items()}
        optimizer.load_state_dict({**state, "state": entries})

    # --- checkpoints ----------------------------------------------------------------
    def save_checkpoint(self, path: str, state: dict) -> None:
        """"full": one file written by rank 0. "sharded": a torch.distributed.checkpoint directory of the net's and
        optimizer's shards (every rank writes its own) plus the rest of the state in FSDP_META_FILE."""
        if self.state_dict_type == "full" or self._sharded is None:
            return super().save_checkpoint(path, state)
        import torch.distributed.checkpoint as dcp
        dcp.save({"net": state["net"], "optimizer": state["optimizer"]}, checkpoint_id=path)
        if self.is_global_zero:
            save_checkpoint_file(os.path.join(path, FSDP_META_FILE),
                                 {**without_weights(state), "param_names": self._names})
        self.barrier()

    def load_checkpoint(self, path: str) -> dict:
        """Either format; a sharded directory may be loaded on another number of processes (it is re-sliced)."""
        if not os.path.isdir(path):
            return super().load_checkpoint(path)
        if self._sharded is None:
            raise directory_outside_fit(path, "sharded", "strategy='fsdp'")
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
        rest = load_checkpoint_file(os.path.join(path, FSDP_META_FILE), map_location="cpu")
        check_dcp_folder(path)   # torch unpickles its metadata: checked as data first
        rest.pop("param_names")
        template = {"net": self._sharded.state_dict(), "optimizer": get_optimizer_state_dict(self._sharded,
                                                                                              self._optimizer)}
        dcp.load(template, checkpoint_id=path)
        return {**rest, **template}
