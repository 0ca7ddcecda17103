"""What the strategies that train DTensor parameters share (FSDP2, tensor and 2-D parallelism): the sharding of a copy
of the user's net is a hook (`build_mesh`, `shard`); everything around it is here once.

The user's net is not sharded in place: a copy is, the user's optimizer is rebuilt over the copy's parameters, and at
the end of fit the full trained weights are loaded back into the user's net (`hand_back=True`, the default), which
evaluate, predict and `model.save` then use. State dicts gather each DTensor into a full tensor (a collective)
unless the checkpoint format is "sharded": a torch.distributed.checkpoint directory each rank writes its slices to.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard

from easyfit.distributed.strategies.capabilities import Capabilities
from easyfit.distributed.strategies.sharded import FULL, SHARDED, ShardedFit, ShardingStrategy
from easyfit.distributed.strategy_parts import sharding
from easyfit.distributed.strategy_parts.sharding import optimizer_params, param_names, without_weights
from easyfit.saving.backend_folders import check_dcp_folder
from easyfit.saving.checkpoint import FSDP_META_FILE, load_checkpoint_file, save_checkpoint_file

#: DDPStrategy's options for its gradient all-reduce, which the DTensor strategies do not run (refused by name)
DDP_COMMUNICATION = ("comm_hook", "powersgd_rank", "powersgd_start_step", "model_averaging_period",
                     "model_averaging_warmup")


def full_tensor(value):
    """A DTensor gathered into one ordinary tensor on the CPU (a collective); other values as they are. On a 2-D mesh
    the outer dimension is gathered first: torch gathers FSDP's shards of a TP shard wrong in one step."""
    if not isinstance(value, DTensor):
        return value
    placements = list(value.placements)
    for dim in range(len(placements) - 1):
        placements[dim] = Replicate()
        value = value.redistribute(value.device_mesh, placements)
    return value.full_tensor().cpu()


def piece(value: torch.Tensor, placement, size: int, coordinate: int) -> torch.Tensor:
    """This coordinate's piece of `value` split `size` ways as a placement of one mesh dimension says."""
    if isinstance(placement, _StridedShard):   # each of split_factor parts (e.g. q, k, v) split `size` ways
        parts = value.chunk(placement.split_factor, placement.dim)
        return torch.cat([chunk(part, size, placement.dim, coordinate) for part in parts], placement.dim)
    return chunk(value, size, placement.dim, coordinate) if isinstance(placement, Shard) else value


def chunk(value: torch.Tensor, size: int, dim: int, coordinate: int) -> torch.Tensor:
    """Chunk `coordinate` of `value` split `size` ways along `dim`, as DTensor shards it: `torch.chunk`'s pieces,
    and an empty one for each coordinate past them (a dimension shorter than `size`, e.g. one row on 2 ranks)."""
    pieces = value.chunk(size, dim)
    return pieces[coordinate] if coordinate < len(pieces) else value.narrow(dim, value.shape[dim], 0)


def shard_like(value, reference):
    """`value` (a full tensor every rank holds) cut into `reference`'s DTensor layout, without communication. On a
    2-D mesh the inner (TP) dimension splits first and the outer one (FSDP) chunks what it left."""
    if not isinstance(reference, DTensor) or not isinstance(value, torch.Tensor) or isinstance(value, DTensor) \
            or value.shape != reference.shape:
        return value
    local = value.to(device=reference.device, dtype=reference.dtype)
    mesh = reference.device_mesh
    if mesh.ndim == 1:
        return distribute_tensor(local, mesh, reference.placements, src_data_rank=None)
    coordinates = mesh.get_coordinate()
    for dim in reversed(range(mesh.ndim)):
        placement = reference.placements[dim]
        sharded = isinstance(placement, (Shard, _StridedShard))
        plain = Shard(placement.dim) if sharded and dim < mesh.ndim - 1 else placement
        local = piece(local, plain, mesh.size(dim), coordinates[dim])
    return DTensor.from_local(local.contiguous(), mesh, reference.placements, run_check=False,
                              shape=reference.shape, stride=reference.stride())


def holds_dtensors(net: torch.nn.Module) -> bool:
    """Whether `net` is a sharded training copy: some of its parameters are DTensors."""
    return any(isinstance(param, DTensor) for param in net.parameters())


@dataclass(kw_only=True)
class DTensorFit(ShardedFit):
    """A DTensor fit: its net is the sharded copy, its optimizer rebuilt over the copy; the user's net, and the
    user's parameter names."""

    user_net: torch.nn.Module
    names: list[str]


class DTensorStrategy(ShardingStrategy):
    """The contract for a copy of the user's net whose parameters are DTensors on a device mesh. torch.compile
    traces a net of DTensors (their collectives become graph nodes): the forward with the loss is compiled, the step
    stays separate calls.

    Args:
        state_dict_type, hand_back: see ShardingStrategy; a "sharded" checkpoint is a torch.distributed.checkpoint
            directory.
    """

    capabilities = Capabilities(supports_compile=True, shards_parameters=True)
    STATE_FORMATS = (FULL, SHARDED)

    def __init__(self, **options):
        ignored = [name for name in DDP_COMMUNICATION if name in options]
        if ignored:
            raise ValueError(f"{type(self).__name__} does not take {', '.join(ignored)}: DDP's gradient "
                             "communication options, which it (its DTensors reduce their gradients themselves) would "
                             "ignore; use DDPStrategy for compressed gradients or local SGD")
        super().__init__(**options)

    # --- the hooks ------------------------------------------------------------------
    def build_mesh(self) -> DeviceMesh:
        """The device mesh of this fit (the process group exists)."""
        raise NotImplementedError

    def shard(self, net: torch.nn.Module, mesh: DeviceMesh, settings) -> None:
        """Turn the training copy's parameters into DTensors on `mesh`, in place, for a fit of `settings` (the
        fit's TrainingSettings, or None)."""
        raise NotImplementedError

    def training_copy(self, net: torch.nn.Module, optimizer: torch.optim.Optimizer) -> torch.nn.Module:
        """The copy of the user's net that `shard` takes apart; the user's net waits on the host."""
        return sharding.copy_to_train(net, optimizer, self.root_device)

    # --- life -----------------------------------------------------------------------
    def setup(self, net: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler=None, settings=None,
              call=None) -> DTensorFit:
        sharded = self.training_copy(net, optimizer)
        self.shard(sharded, self.build_mesh(), settings)
        fit = DTensorFit(strategy=self, net=sharded, optimizer=self.rebuilt_optimizer(optimizer, net, sharded),
                         scheduler=scheduler, call=call, user_net=net, names=param_names(net, optimizer))
        return self.take_over_optimizer(fit, optimizer)

    def hand_back_weights(self, fit: DTensorFit, user_net, user_optimizer) -> None:
        self.load_full_weights(user_net, self._full_module_state(fit.net))

    def load_full_weights(self, user_net: torch.nn.Module, full_state: dict) -> None:
        """The gathered weights into the user's net, on the device it trained on."""
        sharding.load_on_device(user_net, full_state, self.root_device)

    def trains_sharded(self, fit) -> bool:
        return holds_dtensors(fit.net)

    def eval_source(self, fit: DTensorFit) -> torch.nn.Module:
        """The module whose plain copy validation runs: the user's net."""
        return fit.user_net

    def gathered_copy(self, fit: DTensorFit) -> torch.nn.Module:
        return sharding.plain_on_device(self.eval_source(fit), self._full_module_state(fit.net), self.root_device)

    # --- state ----------------------------------------------------------------------
    def module_state(self, fit) -> dict:
        net = fit.net
        if not holds_dtensors(net):
            return super().module_state(fit)
        return net.state_dict() if self.state_dict_type == SHARDED else self._full_module_state(net)

    @staticmethod
    def _full_module_state(net: torch.nn.Module) -> dict:
        return {key: full_tensor(value) for key, value in net.state_dict().items()}

    def local_tensors(self, fit, buffers: bool = False) -> list[torch.Tensor]:
        """Each parameter's shard on this rank (its DTensor's local tensor); buffers are whole on every rank."""
        return [tensor.to_local() if isinstance(tensor, DTensor) else tensor
                for tensor in super().local_tensors(fit, buffers)]

    def load_module_state(self, fit, state: dict) -> None:
        net = fit.net
        if not holds_dtensors(net):
            return super().load_module_state(fit, state)
        own = net.state_dict()
        net.load_state_dict({key: shard_like(value, own[key]) for key, value in state.items()})

    def optimizer_state(self, fit) -> dict:
        if self.state_dict_type == SHARDED and isinstance(fit, DTensorFit):   # keyed by name, each rank its slices
            from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
            return get_optimizer_state_dict(fit.net, fit.optimizer)
        return self.full_optimizer_state(fit)

    def full_optimizer_state(self, fit) -> dict:
        state = fit.optimizer.state_dict()
        return {**state, "state": {index: {key: full_tensor(value) for key, value in entry.items()}
                                   for index, entry in state["state"].items()}}

    def load_optimizer_state(self, fit, state: dict) -> None:
        optimizer = fit.optimizer
        if any(isinstance(key, str) for key in state["state"]):   # the sharded, name-keyed form
            from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict
            return set_optimizer_state_dict(fit.net, optimizer, state)
        params = optimizer_params(optimizer)
        entries = {index: {key: shard_like(value, params[index]) for key, value in entry.items()}
                   for index, entry in state["state"].items()}
        optimizer.load_state_dict({**state, "state": entries})

    # --- checkpoints ----------------------------------------------------------------
    def save_shards(self, fit: DTensorFit, path: str, state: dict) -> None:
        """A torch.distributed.checkpoint directory of the net's and optimizer's shards, plus the rest of the state
        in FSDP_META_FILE."""
        import torch.distributed.checkpoint as dcp
        dcp.save({"net": state["net"], "optimizer": state["optimizer"]}, checkpoint_id=path)
        if self.is_global_zero:
            save_checkpoint_file(os.path.join(path, FSDP_META_FILE),
                                 {**without_weights(state), "param_names": fit.names})
        self.barrier()

    def load_shards(self, fit: DTensorFit, path: str) -> dict:
        """It may have been written by another number of processes (it is re-sliced)."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
        rest = load_checkpoint_file(os.path.join(path, FSDP_META_FILE), map_location="cpu")
        check_dcp_folder(path)   # torch unpickles its metadata: checked as data first
        rest.pop("param_names")
        template = {"net": fit.net.state_dict(), "optimizer": get_optimizer_state_dict(fit.net, fit.optimizer)}
        dcp.load(template, checkpoint_id=path)
        return {**rest, **template}
