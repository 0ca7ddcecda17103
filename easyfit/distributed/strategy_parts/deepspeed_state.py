"""A DeepSpeed engine's training state in the plain form a torch net and optimizer have: the full fp32 parameters
and the optimizer state of every parameter, gathered from the ranks' ZeRO partitions, and set back into them.
Reading and setting are collectives: every rank calls them."""
from __future__ import annotations

import copy

import torch

from easyfit.distributed.strategy_parts.sharding import optimizer_params


class FullState:
    """The full state of `engine`, whose trained parameters are `params` (in the user's optimizer's order, in
    param groups of `group_sizes`); `ranks` gives the root device, global rank and world size."""

    def __init__(self, engine, params: list[torch.nn.Parameter], group_sizes: list[int], ranks):
        self.engine, self.params, self.group_sizes, self.ranks = engine, params, group_sizes, ranks

    def module_state(self) -> dict:
        """The net's state dict with the full fp32 parameters."""
        from deepspeed.utils import safe_get_full_fp32_param
        state = {}
        for key, value in self.engine.module.state_dict(keep_vars=True).items():
            full = safe_get_full_fp32_param(value) if isinstance(value, torch.nn.Parameter) else None
            state[key] = (full if full is not None else value).detach().to("cpu", copy=True)
        return state

    def load_module_state(self, state: dict) -> None:
        import deepspeed
        module = self.engine.module
        params = dict(module.named_parameters())
        for name, param in params.items():
            self._set_full(param, state[name])
        with deepspeed.zero.GatheredParameters(list(params.values()), modifier_rank=0):   # ZeRO-3: re-partitioned
            own = module.state_dict(keep_vars=True)
            with torch.no_grad():
                for key, value in state.items():
                    own[key].copy_(value)

    def optimizer_state(self, optimizer) -> dict:
        """The optimizer state in the plain optimizer's format, full tensors on every rank."""
        from deepspeed.utils import safe_get_full_optimizer_state
        self._relink()
        flat_state = next(iter(optimizer.state.values()), {})
        entries = {}
        if flat_state:
            for index, param in enumerate(self.params):
                entries[index] = {key: (safe_get_full_optimizer_state(param, key).detach().cpu()
                                        if _is_partitioned(value) else _copy(value))
                                  for key, value in flat_state.items()}
        return {"state": entries, "param_groups": self.plain_groups(optimizer)}

    def plain_groups(self, optimizer) -> list[dict]:
        """The param groups as the user's optimizer has them: hyper-parameters and parameter positions."""
        groups, start = [], 0
        for group, size in zip(optimizer.param_groups, self.group_sizes):
            groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": list(range(start,
                                                                                                    start + size))})
            start += size
        return groups

    def load_optimizer_state(self, optimizer, state: dict) -> None:
        for group, saved in zip(optimizer.param_groups, state["param_groups"]):
            group.update({k: v for k, v in saved.items() if k != "params"})
        if not state["state"]:
            return
        template = state["state"][next(iter(state["state"]))]
        for flat in self._flat_partitions(optimizer):
            if not optimizer.state.get(flat):   # before the first step: create the entries, then fill them in
                optimizer.state[flat] = {key: torch.zeros_like(flat) if _is_partitioned(value) else _copy(value)
                                         for key, value in template.items()}
        self._relink()
        for index, param in enumerate(self.params):
            for key, value in state["state"][index].items():
                if _is_partitioned(value):
                    self._set_full(param, value, key)
                else:
                    for flat_state in optimizer.state.values():
                        flat_state[key] = _copy(value)

    def _set_full(self, param: torch.nn.Parameter, value: torch.Tensor, key: str | None = None) -> None:
        """Set the fp32 master copy (key None) or an optimizer state of `param` from its full value. A ZeRO-3
        partition is cut here: DeepSpeed's own full setter misreads the zero padding of the last partition."""
        from deepspeed import utils
        value = value.to(self.ranks.root_device, torch.float32)
        if not hasattr(param, "ds_id"):
            return utils.safe_set_full_fp32_param(param, value) if key is None \
                else utils.safe_set_full_optimizer_state(param, value, key)
        size, rank = param.ds_tensor.numel(), self.ranks.global_rank
        padded = torch.zeros(size * self.ranks.world_size, dtype=value.dtype, device=value.device)
        padded[:value.numel()] = value.flatten()
        local = padded[size * rank:size * (rank + 1)]
        return utils.safe_set_local_fp32_param(param, local) if key is None \
            else utils.safe_set_local_optimizer_state(param, local, key)

    def _flat_partitions(self, optimizer) -> list[torch.Tensor]:
        """The flat fp32 partitions of this rank that the stepping optimizer keeps its state for."""
        zero = self.engine.optimizer
        for name in ("fp32_partitioned_groups_flat", "single_partition_of_fp32_groups"):
            if getattr(zero, name, None) is not None:
                return list(getattr(zero, name))
        return optimizer_params(optimizer)

    def _relink(self) -> None:
        """Point the parameters' fragment maps at the optimizer's state entries (stages 1 and 2, bf16): DeepSpeed
        links them once, after the first param group's first step, when a later group's entries do not exist yet."""
        zero = self.engine.optimizer
        if hasattr(zero, "_lazy_init_hp_params_optimizer_state"):
            zero._hp_optimizer_states_linked = False
            zero._lazy_init_hp_params_optimizer_state()


def _is_partitioned(value) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() > 0


def _copy(value):
    return value.clone() if isinstance(value, torch.Tensor) else copy.deepcopy(value)
