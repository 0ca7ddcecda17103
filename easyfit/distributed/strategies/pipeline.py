"""Pipeline parallelism (torch.distributed.pipelining): an nn.Sequential cut into stages, one stage per rank (several
with the interleaved schedule), each batch run as micro-batches through GPipe, 1F1B or interleaved 1F1B, and, with
fewer stages than ranks, data-parallel replicas of the whole pipeline (a 2-D mesh: pipeline groups x replica groups).

The stages are the user's own layers (moved to this rank's device), trained in place; the optimizer is rebuilt over
this rank's parameters. State is read and written as the whole net's (every rank takes part), so checkpoints are one
file a plain nn.Sequential loads, and load onto any number of stages. See docs/pipeline.md.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from easyfit.data.batches import interleave
from easyfit.distributed.strategies.capabilities import Capabilities
from easyfit.distributed.strategies.ddp2 import average_gradients
from easyfit.distributed.strategies.parallel import ParallelCall, destroy_process_group
from easyfit.distributed.strategies.sharded import ShardedFit, ShardingStrategy
from easyfit.distributed.strategies.states import NOT_LAUNCHED, Launched
from easyfit.distributed.strategy_parts.pipeline_engine import IDENTITY, Layout, PipelinedNet
from easyfit.distributed.strategy_parts.pipeline_split import check_options, layers_of, resolve_balance, stage_layers
from easyfit.distributed.strategy_parts.pipeline_state import (
    full_optimizer_state,
    merge_states,
    stage_optimizer_state,
    stage_part,
)
from easyfit.distributed.strategy_parts.sharding import optimizer_params
from easyfit.parts.precision import Precision


@dataclass
class PipelineCall(ParallelCall):
    """A pipeline call: this rank's (pipeline, replica) process groups, whether the call opened the process group
    itself (one process: a debugging run), and the stages of each net evaluated outside fit, by the net's id."""

    groups: tuple = ()
    own_group: bool = False
    eval_nets: dict[int, PipelinedNet] = field(default_factory=dict)


@dataclass(kw_only=True)
class PipelineFit(ShardedFit):
    """A pipeline fit: its net is this rank's stages, its optimizer over their parameters; each parameter's index in
    the user's optimizer, the user's param groups (state dict form), the whole net's state dict keys in order, the
    parameters whose gradients the replicas average, and whether this step averages them (not in an accumulation
    micro-step)."""

    global_index: list[int]
    user_groups: list[dict]
    keys: list[str]
    trained: list[torch.nn.Parameter]
    synchronise: bool = True


class PipelineStrategy(ShardingStrategy):
    """strategy="pipeline", or `easyfit.strategies.Pipeline(...)` with options.

    Args:
        balance: layers per stage ([2, 2, 1, 1]), or "auto": cuts that give each stage an equal share of the
            parameters as nearly as whole layers allow.
        microbatches: micro-batches each batch is split into (default: 4, at least the number of stages).
        schedule: "gpipe", "1f1b" or "interleaved_1f1b" (`chunks` stages per rank).
        checkpoint: activation checkpointing per micro-batch: "never", "except_last" (default) or "always".
        stages: processes per pipeline (default: every process, or len(balance) / chunks); fewer than the world
            size make data-parallel replicas of the pipeline.
        chunks: stages per rank for "interleaved_1f1b" (default 2).
    """

    name = "pipeline"
    #: each stage's forward takes the previous stage's output alone; the engine weights its micro-batches' losses by
    #: their samples
    capabilities = Capabilities(forward_takes_targets=False, counts_items=False)

    def __init__(self, balance="auto", microbatches: int | None = None, schedule: str = "gpipe",
                 checkpoint: str = "except_last", stages: int | None = None, chunks: int | None = None, **kwargs):
        check_options(balance, microbatches, schedule, checkpoint, stages)
        interleaved = schedule == "interleaved_1f1b"
        if chunks is not None and (not interleaved or not isinstance(chunks, int) or chunks < 1):
            raise ValueError(f"chunks (stages per rank) applies to schedule='interleaved_1f1b' and must be a "
                             f"positive int; got chunks={chunks!r} with schedule={schedule!r}")
        super().__init__(start_method=None, **kwargs)
        self.balance, self.schedule, self.checkpoint = balance, schedule, checkpoint
        self.chunks = chunks or (2 if interleaved else 1)
        self._stages_from_balance = balance != "auto" and stages is None
        if self._stages_from_balance:
            if len(balance) % self.chunks:
                raise ValueError(f"balance {list(balance)} gives {len(balance)} stages, which is not a multiple of "
                                 f"{self.chunks} stages per rank (chunks)")
            stages = len(balance) // self.chunks
        self.stages, self.microbatches = stages, microbatches

    # --- the mesh -------------------------------------------------------------------
    @property
    def pipeline_size(self) -> int:
        return self.stages or self.world_size

    @property
    def layout(self) -> Layout:
        size = self.pipeline_size
        return Layout(size, self.world_size // size, self.global_rank % size, self.global_rank // size, self.chunks)

    @property
    def batch_factor(self) -> int:
        return self.world_size // self.pipeline_size

    def describe_batch_factor(self) -> str:
        return "pipeline replicas" if self.batch_factor != 1 else "pipeline replica"

    def check_call(self, call) -> None:
        if call.interactive and not call.external and len(call.devices) > 1:
            raise ValueError("strategy='pipeline' re-runs your script in each extra process, but this is a notebook "
                             "or REPL: run the code as a script (or under torchrun)")
        world = len(call.devices) * call.num_nodes if not call.external else call.environment.world_size()
        size = self.stages or world
        given = self._stages_given()
        if size > world:
            fewer = f"a balance of at most {world * self.chunks} entries" if self._stages_from_balance \
                else "fewer stages"
            raise ValueError(f"{given} needs at least {size} processes, but the call runs {world}: pass "
                             f"devices={size} (or a multiple of it for data-parallel replicas), or {fewer}")
        if world % size:
            raise ValueError(f"the pipeline has {size} processes per replica ({given}), which does not divide the "
                             f"{world} processes: use a number of devices that is a multiple of {size}")
        if self.schedule == "1f1b" and self.microbatches is not None and self.microbatches < size:
            raise ValueError(f"schedule='1f1b' needs at least as many micro-batches as stages ({size}); got "
                             f"microbatches={self.microbatches}")

    def _stages_given(self) -> str:
        """The argument that set the processes per pipeline, in words: stages=, or the length of balance."""
        if self._stages_from_balance:
            per_rank = f" with {self.chunks} stages per rank (chunks)" if self.chunks > 1 else ""
            return f"balance={list(self.balance)} ({len(self.balance)} stages{per_rank}, one process per " \
                   f"{'rank' if per_rank else 'stage'})"
        return f"stages={self.stages}" if self.stages else "one stage per process"

    def check_net(self, net: nn.Module) -> None:
        """An nn.Sequential with at least one layer per stage, and a balance that places each layer once."""
        resolve_balance(self.balance, layers_of(net), self.layout.num_stages)

    call_state_type = PipelineCall

    def setup_environment(self, launched: Launched = NOT_LAUNCHED) -> PipelineCall:
        own_group = self.world_size == 1 and not dist.is_initialized()
        call = super().setup_environment(launched)
        # every rank creates every group, in the same order
        size, replicas = self.pipeline_size, self.world_size // self.pipeline_size
        pipelines = [dist.new_group([r * size + s for s in range(size)]) for r in range(replicas)]
        replica_groups = [dist.new_group([r * size + s for r in range(replicas)]) for s in range(size)]
        call.groups, call.own_group = (pipelines[self.layout.replica], replica_groups[self.layout.pp_rank]), own_group
        call.subgroups += [*pipelines, *replica_groups]
        return call

    def teardown(self, call: PipelineCall) -> None:
        """A pipeline of one process (a debugging run) ends the process group it opened with the call."""
        super().teardown(call)
        if call.own_group:
            destroy_process_group()

    # --- precision ------------------------------------------------------------------
    def check_precision(self, precision: str) -> None:
        if precision == "16-mixed":
            raise ValueError("strategy='pipeline' trains in precision '32', 'bf16-mixed' or '64'; '16-mixed' scales "
                             "the loss and would skip a step on some stages only. Use precision='bf16-mixed'.")

    # --- the net --------------------------------------------------------------------
    def _split(self, net: nn.Module, call: PipelineCall) -> PipelinedNet:
        """This rank's stages of `net` (its own layers, moved to this rank's device), ready to run in `call`."""
        layers = layers_of(net)
        layout = self.layout
        balance = resolve_balance(self.balance, layers, layout.num_stages)
        mine = [stage_layers(layers, balance, index).to(self.root_device) for index in layout.local_stages]
        microbatches = self.microbatches or max(4, layout.pipeline_size)
        return PipelinedNet(mine, layout, call.groups[0], self.root_device, self.schedule, microbatches,
                            self.checkpoint)

    def setup(self, net: nn.Module, optimizer: torch.optim.Optimizer, scheduler=None, settings=None,
              call=None) -> PipelineFit:
        pipelined = self._split(net, call)
        own = {id(p) for p in pipelined.parameters()}
        indices = {id(p): index for index, p in enumerate(optimizer_params(optimizer))}
        rebuilt = self.rebuilt_optimizer(optimizer)
        for group in rebuilt.param_groups:   # this stage's parameters only
            group["params"] = [p for p in group["params"] if id(p) in own]
        fit = PipelineFit(strategy=self, net=pipelined, optimizer=rebuilt, scheduler=scheduler, call=call,
                          global_index=[indices[id(p)] for p in optimizer_params(rebuilt)],
                          user_groups=optimizer.state_dict()["param_groups"], keys=list(net.state_dict()),
                          trained=[p for p in pipelined.parameters() if p.requires_grad])
        return self.take_over_optimizer(fit, optimizer)

    def hand_back_weights(self, fit: PipelineFit, user_net, user_optimizer) -> None:
        """Every rank: the whole trained net (stage layers were trained in place, the others arrive from their
        ranks)."""
        user_net.load_state_dict(self.module_state(fit))

    def module_for_eval(self, fit) -> nn.Module:
        """The pipelined net during fit; outside fit, this rank's stages of the user's net (split once per call)."""
        net = fit.net
        if isinstance(net, PipelinedNet):
            return net
        eval_nets = fit.call.eval_nets
        if id(net) not in eval_nets:
            eval_nets[id(net)] = self._split(net, fit.call)
        return eval_nets[id(net)]

    # --- where outputs live ---------------------------------------------------------
    def training_step(self, fit: PipelineFit, inputs, target, step_fn, precision: Precision, divisor: int = 1):
        with precision.autocast():
            output, target, loss = fit.net.train_batch(inputs, target, step_fn, divisor)
        if fit.synchronise and self.batch_factor > 1:   # over the replicas of this rank's stage
            average_gradients(fit.trained, self.batch_factor, fit.call.groups[1])
        return output, target, self._share_loss(loss, fit.net.group)

    def evaluation_step(self, net, inputs, target, step_fn, precision: Precision):
        """The pipelined forward; the loss (when there is a target: not in predict) on the last stage, shared."""
        with precision.autocast():
            output, loss = net(inputs), None
            if target is None:
                return output, None, None
            if output is not None:
                _, target, loss = step_fn(IDENTITY, output, target)
        return output, target, self._share_loss(loss, net.group)

    def _share_loss(self, loss: torch.Tensor | None, pipeline) -> torch.Tensor:
        """The last stage's loss on every rank of its pipeline (the process group `pipeline`), so every rank logs
        and tracks the same loss."""
        value = torch.zeros((), dtype=torch.float64, device=self.root_device) if loss is None \
            else loss.detach().double()
        if self.pipeline_size > 1:
            dist.broadcast(value, src=self.layout.last_rank, group=pipeline)
        return value

    def gather_outputs(self, local: torch.Tensor) -> torch.Tensor:
        """Predictions from each replica's last stage, back in input order."""
        parts = self.all_gather(local)
        layout = self.layout
        return interleave([parts[layout.global_rank(layout.pipeline_size - 1, replica)]
                           for replica in range(layout.replicas)])

    # --- the step -------------------------------------------------------------------
    @contextlib.contextmanager
    def no_sync(self, fit: PipelineFit):
        fit.synchronise = False
        try:
            yield
        finally:
            fit.synchronise = True

    def clip_gradients(self, fit: PipelineFit, max_norm: float, precision: Precision) -> None:
        """Clip to a total norm over every stage's gradients (each replica holds the same, averaged ones)."""
        precision.unscale_gradients(fit.optimizer)
        grads = [p.grad for p in fit.net.parameters() if p.grad is not None]
        squares = torch.zeros((), dtype=torch.float32, device=self.root_device)
        if grads:
            squares = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])) ** 2
        if self.pipeline_size > 1:
            dist.all_reduce(squares, group=fit.call.groups[0])
        scale = torch.clamp(max_norm / (squares.sqrt() + 1e-6), max=1.0)
        for grad in grads:
            grad.mul_(scale.to(grad.dtype))

    # --- state (every rank) ---------------------------------------------------------
    def module_state(self, fit) -> dict:
        if not isinstance(fit, PipelineFit):
            return super().module_state(fit)
        own = {key: value.detach().cpu() for layers in fit.net.layers() for key, value in layers.state_dict().items()}
        return merge_states(self._gather_pipeline(own, fit.call), fit.keys)

    def load_module_state(self, fit, state: dict) -> None:
        if not isinstance(fit, PipelineFit):
            return super().load_module_state(fit, state)
        for layers in fit.net.layers():
            layers.load_state_dict({key: state[key] for key in layers.state_dict()})

    def optimizer_state(self, fit) -> dict:
        if not isinstance(fit, PipelineFit):
            return super().optimizer_state(fit)
        own = stage_optimizer_state(fit.optimizer.state_dict(), fit.global_index)
        return full_optimizer_state(self._gather_pipeline(own, fit.call), fit.user_groups)

    def load_optimizer_state(self, fit, state: dict) -> None:
        if not isinstance(fit, PipelineFit):
            return super().load_optimizer_state(fit, state)
        fit.optimizer.load_state_dict(stage_part(state, fit.global_index))

    def _gather_pipeline(self, obj, call: PipelineCall) -> list:
        """`obj` from every stage of this rank's pipeline in `call`."""
        if self.pipeline_size == 1:
            return [obj]
        gathered = [None] * self.pipeline_size
        dist.all_gather_object(gathered, obj, group=call.groups[0])
        return gathered

    # --- data: one share per replica ------------------------------------------------
    @property
    def data_parallel_rank(self) -> int:
        return self.layout.replica

    @property
    def data_parallel_size(self) -> int:
        return self.layout.replicas
