"""The collectives a strategy runs (`reduce`, `all_gather`, `broadcast`, `barrier`), written once over a backend's
primitives: torch.distributed, Horovod, torch_xla, or one process alone.

`Collectives` owns what every backend shares: the reduce ops and "a mean is the sum divided by the size", scalars
gathered as one element, and the padded all_gather (tensors whose first dimensions differ between ranks). A backend
subclass supplies only the primitives. Strategies build theirs on each use, so a pickled strategy carries none.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

#: the reduce ops a caller may ask for, each with the op the backend runs for it (a mean is a sum, divided after)
REDUCE_OPS = {"sum": "sum", "mean": "sum", "max": "max", "min": "min"}


class Collectives:
    """The collectives among `size` ranks, their tensors sent from `device` (None: where each tensor is). This class
    alone serves one process: every collective hands back its input."""

    #: at world size 1 each collective hands back its input without calling the backend
    skips_alone = True
    #: the backend gathers bool tensors; else they travel as uint8
    gathers_bool = True

    def __init__(self, size: int = 1, device: torch.device | None = None):
        self.size, self.device = size, device

    @property
    def _alone(self) -> bool:
        return self.skips_alone and self.size == 1

    # --- what every backend shares ----------------------------------------------------
    def reduce(self, tensor: torch.Tensor, op: str = "sum", group: Any = None) -> torch.Tensor:
        """Reduce over the ranks of `group` (None: every rank): "sum", "mean", "max" or "min"."""
        if op not in REDUCE_OPS:
            raise ValueError(f"reduce op must be one of {', '.join(REDUCE_OPS)}, got {op!r}")
        if self._alone:
            return tensor
        result = self._all_reduce(tensor, REDUCE_OPS[op], group)
        return result / self.group_size(group) if op == "mean" else result

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's tensor, in rank order. Their first dimensions may differ, and a rank may hold none (an empty
        tensor of any shape): the tensors are padded to the longest for the transfer and trimmed after."""
        if self._alone:
            return [tensor]
        if tensor.dim() == 0:   # a scalar (e.g. a metric's running sum): gathered as one element
            return [part.reshape(()) for part in self.all_gather(tensor.reshape(1))]
        meta = self._gather_objects((len(tensor), tuple(tensor.shape[1:]), tensor.dtype))
        trailing, dtype = next(((shape, dtype) for length, shape, dtype in meta if length), meta[0][1:])
        sent = torch.uint8 if dtype == torch.bool and not self.gathers_bool else dtype
        device = tensor.device if self.device is None else self.device
        padded = torch.zeros((max(length for length, _, _ in meta), *trailing), dtype=sent, device=device)
        if len(tensor):   # a rank with no rows (fewer samples than processes) sends padding only
            padded[:len(tensor)] = tensor.to(device)
        gathered = self._gather(padded)
        return [part[:length].to(tensor.device, dtype) for part, (length, _, _) in zip(gathered, meta)]

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """Rank `src`'s `obj` on every rank."""
        return obj if self._alone else self._broadcast(obj, src)

    def barrier(self) -> None:
        """Wait for every rank."""
        if not self._alone:
            self._barrier()

    def group_size(self, group: Any = None) -> int:
        """How many ranks `group` holds (None: every rank)."""
        return self.size

    # --- the primitives a backend supplies --------------------------------------------
    def _all_reduce(self, tensor: torch.Tensor, op: str, group: Any) -> torch.Tensor:
        """`tensor` reduced over `group` with "sum", "max" or "min"."""
        raise NotImplementedError

    def _gather_objects(self, obj: Any) -> list:
        """Every rank's small picklable `obj`, in rank order."""
        raise NotImplementedError

    def _gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's `tensor`, in rank order; every rank's has the same shape and dtype."""
        raise NotImplementedError

    def _broadcast(self, obj: Any, src: int) -> Any:
        raise NotImplementedError

    def _barrier(self) -> None:
        raise NotImplementedError


class TorchCollectives(Collectives):
    """torch.distributed's default process group (or a subgroup, for `reduce`). `device` is where the group's backend
    takes tensors (NCCL: CUDA only), which the strategy knows."""

    skips_alone = False

    def _all_reduce(self, tensor: torch.Tensor, op: str, group: Any) -> torch.Tensor:
        result = tensor.to(self.device, copy=True)
        dist.all_reduce(result, op=getattr(dist.ReduceOp, op.upper()), group=group)
        return result.to(tensor.device)

    def group_size(self, group: Any = None) -> int:
        return self.size if group is None else dist.get_world_size(group)

    def _gather_objects(self, obj: Any) -> list:
        gathered = [None] * self.size
        dist.all_gather_object(gathered, obj)
        return gathered

    def _gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        gathered = [torch.empty_like(tensor) for _ in range(self.size)]
        dist.all_gather(gathered, tensor)
        return gathered

    def _broadcast(self, obj: Any, src: int) -> Any:
        holder = [obj]
        dist.broadcast_object_list(holder, src=src)
        return holder[0]

    def _barrier(self) -> None:
        if dist.is_initialized():
            dist.barrier()


class HorovodCollectives(Collectives):
    """Horovod's collectives, given its `horovod.torch` module; tensors stay on their own device."""

    skips_alone = False
    gathers_bool = False

    def __init__(self, hvd, size: int):
        super().__init__(size)
        self.hvd = hvd

    def _all_reduce(self, tensor: torch.Tensor, op: str, group: Any) -> torch.Tensor:
        return self.hvd.allreduce(tensor, op=getattr(self.hvd, op.capitalize()))

    def _gather_objects(self, obj: Any) -> list:
        return self.hvd.allgather_object(obj)

    def _gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        return list(self.hvd.allgather(tensor.unsqueeze(0)).unbind(0))

    def _broadcast(self, obj: Any, src: int) -> Any:
        # one name on every rank: Horovod matches collectives by name, and its default is the object's type
        return self.hvd.broadcast_object(obj, root_rank=src, name="easyfit.broadcast")

    def _barrier(self) -> None:
        if self.hvd.is_initialized():
            self.hvd.barrier()


class XlaCollectives(Collectives):
    """torch_xla's collectives among the replicas, tensors sent from this process's XLA `device`; at world size 1
    each hands back its input."""

    def _all_reduce(self, tensor: torch.Tensor, op: str, group: Any) -> torch.Tensor:
        xm = _xla_model()
        return xm.all_reduce(getattr(xm, f"REDUCE_{op.upper()}"), tensor.to(self.device))

    def _gather_objects(self, obj: Any) -> list:
        return _xla_model().mesh_reduce("easyfit.all_gather", obj, list)

    def _gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        return list(_xla_model().all_gather(tensor.unsqueeze(0)).unbind(0))

    def _broadcast(self, obj: Any, src: int) -> Any:
        return _xla_model().mesh_reduce("easyfit.broadcast", obj, lambda objects: objects[src])

    def _barrier(self) -> None:
        _xla_model().rendezvous("easyfit.barrier")


def _xla_model():
    """`torch_xla.core.xla_model`, imported on use (easyfit never imports torch_xla on its own)."""
    import torch_xla.core.xla_model as xm
    return xm
