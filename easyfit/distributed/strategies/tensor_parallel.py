"""Tensor and 2-D parallelism (torch.distributed.tensor.parallel): strategy="tp", "fsdp_tp", ModelParallel(...).

The processes form a (dp, tp) device mesh. Inside each row of tp ranks the net's layers are split as a plan says
(each rank holds a slice of each split weight and computes its part of the layer); over the dp dimension the ranks
train on different batches, their parameters sharded by FSDP2 when there are several (torch's 2-D recipe: the TP
plan first, then fully_shard over dp). Everything around the sharding is DTensorStrategy's (shared with FSDP).

The ranks of one TP group see the same batch: the data is split over dp only, the effective batch counts dp ranks,
and sums over ranks (the loss, metrics, predictions) count each TP group once.
"""
from __future__ import annotations

import functools
from typing import Callable

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_leaves

from easyfit.distributed.strategies.dtensor import DTensorFit, DTensorStrategy
from easyfit.distributed.strategies.fsdp import fully_shard_net
from easyfit.distributed.strategy_parts.tp_auto import auto_plan
from easyfit.distributed.strategy_parts.tp_plan import SplitPlan, check_sequence_parallel, parse_plan


def check_size(value, name: str) -> None:
    if value != "auto" and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
        raise ValueError(f"{name} must be 'auto' or a positive integer, got {value!r}")


def mesh_shape(world: int, per_node: int, tensor_parallel_size, data_parallel_size) -> tuple[int, int]:
    """(dp, tp) for `world` processes: "auto" for both puts TP inside each node (`per_node` processes) and dp
    across nodes; one "auto" is the processes the other leaves."""
    tp, dp = tensor_parallel_size, data_parallel_size
    if tp == "auto" and dp == "auto":
        tp = per_node
    for given, name in ((tp, "tensor_parallel_size"), (dp, "data_parallel_size")):
        if given != "auto" and world % given:
            raise ValueError(f"{name}={given} does not divide the {world} processes of this fit: use a size that "
                             f"divides {world} ({', '.join(str(d) for d in range(1, world + 1) if world % d == 0)}), "
                             "or start a multiple of it")
    dp = world // tp if dp == "auto" else dp
    tp = world // dp if tp == "auto" else tp
    if dp * tp != world:
        raise ValueError(f"data_parallel_size={dp} × tensor_parallel_size={tp} is {dp * tp} processes, but this fit "
                         f"has {world}: make their product {world}")
    return dp, tp


def check_sequence_length(tp: int, net, args, kwargs) -> None:
    """Under sequence parallelism each of the `tp` ranks takes an equal part of the sequence (dim 1 of each input)."""
    for tensor in tree_leaves((args, kwargs)):
        if isinstance(tensor, torch.Tensor) and tensor.dim() >= 2 and tensor.shape[1] % tp:
            raise ValueError(f"sequence_parallel=True gives each of the {tp} tensor-parallel ranks an equal part of "
                             f"the sequence (dim 1), but an input has length {tensor.shape[1]} (shape "
                             f"{tuple(tensor.shape)}): pad the sequences to a multiple of {tp}")


#: (device type, shape) -> (the default process group it was made in, the (dp, tp) mesh)
_MESHES: dict[tuple, tuple] = {}


def process_mesh(device_type: str, shape: tuple[int, int]) -> DeviceMesh:
    """The process's (dp, tp) mesh of this shape, made by every rank together on first use and kept while the default
    process group lives: torch keeps a mesh's groups and sub-meshes for the process, so each call's new mesh would
    add groups that never end."""
    made_in, mesh = _MESHES.get((device_type, shape), (None, None))
    if mesh is None or made_in is not dist.group.WORLD:
        mesh = init_device_mesh(device_type, shape, mesh_dim_names=("dp", "tp"))
        _MESHES[(device_type, shape)] = dist.group.WORLD, mesh
    return mesh


class ModelParallelStrategy(DTensorStrategy):
    """Tensor parallelism inside groups of `tensor_parallel_size` ranks, FSDP2 over `data_parallel_size` groups.

    Args:
        tensor_parallel_size, data_parallel_size: the mesh; "auto" for both: TP inside each node, dp across nodes;
            one "auto": the processes the other leaves.
        plan: "auto" (easyfit finds the splits it can prove safe, see tp_auto), a dict
            {"module.path" (glob patterns allowed): "colwise" | "rowwise" | "sequence" | "heads" | a ParallelStyle},
            or a callable (net, tp_mesh) -> None that splits the net itself (e.g. with parallelize_module).
        sequence_parallel: between the split layers, each rank holds its part of the sequence (dim 1 of
            (batch, sequence, features) activations; each input's dim 1 must divide by the TP size): a row-wise layer's
            output is reduce-scattered along it, a column-wise layer's or attention's input gathered, and the norms
            between them ("sequence" splits) run on the parts. Activation memory between the splits falls by the TP
            size. Only a dict plan says where the norms are (every module with parameters must be in it), so "auto"
            refuses it; a callable plan applies its own styles.
        loss_parallel: the cross-entropy is computed on logits split over the classes, never gathered (torch's
            loss_parallel); the plan's last split must be the output layer, column-wise.
        state_dict_type, hand_back, start_method, placement: see ShardingStrategy.
    """

    def __init__(self, *, tensor_parallel_size="auto", data_parallel_size="auto", plan="auto",
                 sequence_parallel: bool = False, loss_parallel: bool = False, **options):
        super().__init__(**options)
        check_size(tensor_parallel_size, "tensor_parallel_size")
        check_size(data_parallel_size, "data_parallel_size")
        if not (plan == "auto" or isinstance(plan, dict) or callable(plan)):
            raise TypeError(f"plan must be 'auto', a dict of module paths to styles or a callable (net, mesh) -> "
                            f"None, got {type(plan).__name__}")
        if sequence_parallel and plan == "auto":
            raise ValueError("sequence_parallel=True needs a plan that says where the activations are split along "
                             "the sequence, which plan='auto' does not find: pass a dict plan with 'sequence' "
                             "entries (e.g. for the LayerNorms) or a callable plan")
        self.tensor_parallel_size, self.data_parallel_size_asked = tensor_parallel_size, data_parallel_size
        self.plan, self.sequence_parallel, self.loss_parallel = plan, sequence_parallel, loss_parallel
        self.name = "tp" if data_parallel_size == 1 else "fsdp_tp"

    def configure(self, *args, **kwargs) -> None:
        """Also the mesh's shape, checked against the process count, and the name it makes ("tp": no dp)."""
        super().configure(*args, **kwargs)
        self.name = "tp" if self.data_parallel_size == 1 else "fsdp_tp"

    # --- the mesh -------------------------------------------------------------------
    @property
    def shape(self) -> tuple[int, int]:
        """(dp, tp) of this fit's mesh."""
        return mesh_shape(self.world_size, self.num_processes if self.num_nodes > 1 else self.world_size,
                          self.tensor_parallel_size, self.data_parallel_size_asked)

    @property
    def data_parallel_size(self) -> int:
        return self.shape[0]

    @property
    def data_parallel_rank(self) -> int:
        return self.global_rank // self.shape[1]

    @property
    def batch_factor(self) -> int:
        return self.data_parallel_size

    def describe_batch_factor(self) -> str:
        tp = self.shape[1]
        return f"data-parallel group{'s' if self.batch_factor != 1 else ''} of {tp} tensor-parallel ranks"

    def build_mesh(self) -> DeviceMesh:
        return process_mesh(self.root_device.type, self.shape)

    # --- checks, before any rank starts -----------------------------------------------
    def plan_for(self, net: torch.nn.Module) -> SplitPlan | None:
        """The plan for `net` (None: the user's callable splits it); raises on a plan that does not fit it."""
        if callable(self.plan) and not isinstance(self.plan, dict):
            return None
        tp = self.shape[1]
        if self.plan == "auto":
            return auto_plan(net, tp)
        plan = parse_plan(net, self.plan, tp)
        check_sequence_parallel(net, plan, self.sequence_parallel)
        return plan

    def check_net(self, net: torch.nn.Module) -> None:
        plan = self.plan_for(net)
        if self.loss_parallel and plan is not None:
            from easyfit.distributed.strategy_parts.tp_apply import output_layer
            output_layer(plan)

    def describe_setup(self, fit=None) -> str | None:
        """The mesh, and in a fit the plan that split its net."""
        dp, tp = self.shape
        mesh = f"mesh {dp} data-parallel{' (FSDP)' if dp > 1 else ''} × {tp} tensor-parallel"
        if not isinstance(fit, DTensorFit):
            return mesh
        plan = self.plan_for(fit.user_net)
        if plan is None:
            return f"{mesh}; plan: {getattr(self.plan, '__name__', 'callable')}"
        return f"{mesh}; {plan.summary()}"

    # --- sharding ---------------------------------------------------------------------
    def shard(self, net: torch.nn.Module, mesh: DeviceMesh, settings) -> None:
        from easyfit.distributed.strategy_parts.tp_apply import apply_plan
        plan = self.plan_for(net)   # of the training copy
        if plan is None:
            self.plan(net, mesh["tp"])
        else:
            apply_plan(net, mesh["tp"], plan, self.loss_parallel, self.sequence_parallel)
        if self.sequence_parallel:
            net.register_forward_pre_hook(functools.partial(check_sequence_length, self.shape[1]), with_kwargs=True)
        if self.data_parallel_size > 1:
            fully_shard_net(net, {"mesh": mesh["dp"]})

    # --- the step -------------------------------------------------------------------
    def training_step(self, fit, inputs, target, step_fn: Callable, precision, divisor: int = 1):
        """With loss_parallel, the forward, loss and backward run in torch's loss_parallel context: the loss is taken
        on the logits split over the classes; the output is gathered afterwards for metrics."""
        if not self.loss_parallel:
            return super().training_step(fit, inputs, target, step_fn, precision, divisor)
        from torch.distributed.tensor.parallel import loss_parallel

        def checked(net, inputs, target):
            output, target, loss = step_fn(net, inputs, target)
            if not isinstance(output, DTensor):
                raise ValueError("loss_parallel=True needs the net's output as a DTensor split over the classes, "
                                 f"but it is a {type(output).__name__}: split the output layer with "
                                 "ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)")
            return output, target, loss
        with loss_parallel():
            output, target, loss = super().training_step(fit, inputs, target, checked, precision, divisor)
        return output.full_tensor(), target, loss.full_tensor() if isinstance(loss, DTensor) else loss

    def clip_gradients(self, fit, max_norm: float, precision) -> None:
        """The total norm over every gradient: each DTensor's norm over its full tensor (the ranks' slices), each
        plain gradient (the same on every TP rank) once."""
        precision.unscale_gradients(fit.optimizer)
        grads = [param.grad for param in fit.net.parameters() if param.grad is not None]
        norms = [torch.linalg.vector_norm(grad) for grad in grads]
        total = torch.linalg.vector_norm(torch.stack([norm.full_tensor() if isinstance(norm, DTensor) else norm
                                                      for norm in norms]))
        coefficient = float(torch.clamp(max_norm / (total + 1e-6), max=1.0))
        for grad in grads:
            grad.mul_(coefficient)

    # --- collectives: sums count each TP group once ---------------------------------
    def reduce_group(self, op: str) -> dist.ProcessGroup | None:
        """"max" and "min" over every rank (every rank gets the same answer); "sum" and "mean" over the dp ranks,
        as the ranks of a TP group hold the same batch."""
        if op not in ("sum", "mean") or self.data_parallel_size == self.world_size:
            return super().reduce_group(op)
        return self.build_mesh()["dp"].get_group()

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """One tensor per dp rank (its TP group's first rank's), in dp order."""
        return super().all_gather(tensor)[::self.shape[1]]
