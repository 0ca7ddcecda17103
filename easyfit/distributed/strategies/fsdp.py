"""PyTorch FSDP2 (`torch.distributed.fsdp.fully_shard`): parameters, gradients and optimizer state sharded over the
ranks. Each parameter becomes a DTensor holding this rank's slice; everything around the sharding (the copy, the
rebuilt optimizer, state dicts, checkpoints, the hand-back) is DTensorStrategy's.

A net built under `module_construction()` is on the meta device: its copy is materialized and sharded one unit at a
time (meta_init).
"""
from __future__ import annotations

import contextlib
import copy
from collections import Counter

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

from easyfit.distributed.strategies.capabilities import Capabilities
from easyfit.distributed.strategies.dtensor import DTensorStrategy
from easyfit.distributed.strategy_parts.construction import META, built_sharded
from easyfit.distributed.strategy_parts.meta_init import (
    check_initializable,
    construction_rng,
    materialize,
    materialize_sharded,
    on_meta_device,
    uninitializable,
)
from easyfit.parts.precision import Precision

CONTAINERS = (torch.nn.Sequential, torch.nn.ModuleList, torch.nn.ModuleDict)


class PolicyPrecision(Precision):
    """Mixed precision expressed by FSDP2's MixedPrecisionPolicy (it casts parameters and inputs): no autocast."""

    def autocast(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()


def shard_units(net: torch.nn.Module) -> list[torch.nn.Module]:
    """The submodules each sharded (and gathered) as one unit: every module with parameters that is a direct child
    of the net or of a container in it (Sequential, ModuleList, ModuleDict), except those sharing a parameter with
    another (a tied embedding and output layer), which stay in the net's own unit."""
    units = []

    def visit(module: torch.nn.Module) -> None:
        for child in module.children():
            if isinstance(child, CONTAINERS):
                visit(child)
            elif any(True for _ in child.parameters()):
                units.append(child)
    visit(net)
    holders = Counter(id(param) for unit in units for param in unit.parameters())
    return [unit for unit in units if all(holders[id(param)] == 1 for param in unit.parameters())]


def fully_shard_net(net: torch.nn.Module, options: dict, rng_state=None) -> None:
    """FSDP2 over `net`'s shard units, then its root (`options`: fully_shard's). A net on the meta device is
    materialized one unit at a time, every rank from `rng_state` (rank 0's RNG state at its construction)."""
    if rng_state is not None:
        return materialize_sharded(net, shard_units(net), lambda unit: fully_shard(unit, **options), rng_state)
    for unit in shard_units(net):
        fully_shard(unit, **options)
    fully_shard(net, **options)


class FSDPStrategy(DTensorStrategy):
    """strategy="fsdp" / "fsdp_cpu_offload".

    Args:
        cpu_offload: keep the sharded parameters, gradients and optimizer state in CPU memory between uses.
        state_dict_type, hand_back, start_method, placement: see ShardingStrategy.
    """

    capabilities = Capabilities(supports_compile=True, shards_parameters=True, trains_built_sharded=META)

    def __init__(self, *, cpu_offload: bool = False, **options):
        super().__init__(**options)
        self.cpu_offload = cpu_offload
        self.name = "fsdp_cpu_offload" if cpu_offload else "fsdp"

    # --- precision ------------------------------------------------------------------
    def precision_plugin(self, current: Precision, requested) -> Precision:
        plugin = super().precision_plugin(current, requested)
        if plugin.autocast_dtype is None or isinstance(plugin, PolicyPrecision):
            return plugin
        policy = PolicyPrecision(plugin.name, plugin.device)
        policy.load_state_dict(plugin.state_dict())
        return policy

    @staticmethod
    def _mixed_precision(settings) -> MixedPrecisionPolicy:
        """The policy of the precision of a fit of `settings` (its TrainingSettings; "32" when None)."""
        dtype = {"16-mixed": torch.float16, "bf16-mixed": torch.bfloat16}.get(getattr(settings, "precision", "32"))
        return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32 if dtype else None,
                                    output_dtype=torch.float32 if dtype else None)

    # --- life -----------------------------------------------------------------------
    def module_construction(self) -> contextlib.AbstractContextManager:
        """Modules built in this context are on the meta device (no memory); `setup` materializes the net one shard
        unit at a time, with the weights it would have had if built whole. It needs no ranks yet."""
        return on_meta_device()

    def training_copy(self, net: torch.nn.Module, optimizer: torch.optim.Optimizer) -> torch.nn.Module:
        if built_sharded(net) == META:   # the copy stays on the meta device until `shard` materializes it
            check_initializable(uninitializable(net))
            return copy.deepcopy(net)
        return super().training_copy(net, optimizer)

    def build_mesh(self) -> DeviceMesh:
        return init_device_mesh(self.root_device.type, (self.world_size,))

    def shard(self, net: torch.nn.Module, mesh: DeviceMesh, settings) -> None:
        options = {"mesh": mesh, "mp_policy": self._mixed_precision(settings)}
        if self.cpu_offload:
            options["offload_policy"] = CPUOffloadPolicy(pin_memory=self.root_device.type == "cuda")
        on_meta = built_sharded(net) == META   # a copy of a meta net: every rank initializes from rank 0's RNG state
        fully_shard_net(net, options, self.broadcast(construction_rng(net)) if on_meta else None)

    def load_full_weights(self, user_net: torch.nn.Module, full_state: dict) -> None:
        if built_sharded(user_net) == META:   # built under module_construction(): materialized on the CPU
            materialize(user_net)
            user_net.load_state_dict(full_state)
        else:
            super().load_full_weights(user_net, full_state)

    def eval_source(self, fit) -> torch.nn.Module:
        """A net built on the meta device stays there until the fit hands the weights back: a materialized copy."""
        source = fit.user_net
        if built_sharded(source) == META:
            source = copy.deepcopy(source)
            materialize(source)
        return source
