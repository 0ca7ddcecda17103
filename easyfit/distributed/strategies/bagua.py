"""Bagua: data parallel training with Bagua's algorithms (`bagua.torch_api`), on CUDA GPUs with NCCL.

Written against Bagua 0.9's API: `bagua.torch_api.init_process_group`, `net.with_bagua([optimizer], algorithm)`,
the algorithm classes in `bagua.torch_api.algorithms`, `QAdamOptimizer`, and the asynchronous algorithm's
`abort` / `resume` around evaluation. Bagua's last release needs CUDA <= 11.x, NCCL and Python <= 3.9; where it
cannot be imported, building the strategy raises an error naming the torch-native DDP option that does the same
job (docs/bagua.md says what is verified where).
"""
from __future__ import annotations

import contextlib
import importlib
import sys
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from easyfit.distributed.environments import ClusterEnvironment
from easyfit.distributed.strategies.base import Strategy
from easyfit.distributed.strategies.parallel import DEFAULT_TIMEOUT, ParallelStrategy
from easyfit.distributed.strategies.states import Fit

DDP_IMPORT = "from easyfit.distributed.strategies.ddp import DDPStrategy"


@dataclass(frozen=True)
class Algorithm:
    """One of Bagua's algorithms: where its class lives, the options it takes, and easyfit's torch-native
    counterpart (a DDPStrategy option)."""

    module: str
    cls: str
    options: tuple[str, ...]
    equivalent: str
    idea: str


ALGORITHMS = {
    "gradient_allreduce": Algorithm("gradient_allreduce", "GradientAllReduceAlgorithm", ("hierarchical", "average"),
                                    "DDPStrategy()", "the same gradient all-reduce"),
    "bytegrad": Algorithm("bytegrad", "ByteGradAlgorithm", ("hierarchical", "average"),
                          "DDPStrategy(comm_hook='fp16')", "compressed gradient all-reduce (16 bits instead of 8)"),
    "decentralized": Algorithm("decentralized", "DecentralizedAlgorithm",
                               ("hierarchical", "peer_selection_mode", "communication_interval"),
                               "DDPStrategy(model_averaging_period=4)",
                               "local steps with model averaging over all ranks every few steps"),
    "low_precision_decentralized": Algorithm("decentralized", "LowPrecisionDecentralizedAlgorithm",
                                             ("hierarchical", "communication_interval"),
                                             "DDPStrategy(model_averaging_period=4)",
                                             "local steps with periodic model averaging (full precision)"),
    "async": Algorithm("async_model_average", "AsyncModelAverageAlgorithm",
                       ("peer_selection_mode", "sync_interval_ms", "warmup_steps"),
                       "DDPStrategy(model_averaging_period=4)",
                       "model averaging every few steps, synchronously instead of in a background thread"),
    "qadam": Algorithm("q_adam", "QAdamAlgorithm", ("hierarchical",), "DDPStrategy(comm_hook='powersgd')",
                       "Adam with compressed communication and error feedback (low-rank instead of 1-bit momentum)"),
}


def torch_equivalent(algorithm: str) -> str:
    """A sentence naming the DDP option that does `algorithm`'s job on PyTorch's own engine."""
    spec = ALGORITHMS[algorithm]
    return (f"The torch-native equivalent of Bagua's {algorithm!r} in easyfit is {spec.equivalent} ({spec.idea}): "
            f"`{DDP_IMPORT}` and fit(..., strategy={spec.equivalent}). It runs on gloo (CPU) and nccl (GPU).")


def import_bagua(algorithm: str):
    """`bagua.torch_api`, or an ImportError that explains why Bagua is not available and what to use instead."""
    try:
        return importlib.import_module("bagua.torch_api")
    except (ImportError, OSError) as error:
        python = f"{sys.version_info[0]}.{sys.version_info[1]}"
        raise ImportError(
            f"strategy='bagua' needs Bagua, which cannot be imported here ({type(error).__name__}: {error}). Bagua's "
            "last release (0.9.2, 2023, no longer maintained) needs CUDA <= 11.x and NCCL, has no CPU path, and "
            f"has wheels for Python <= 3.9 only (this is Python {python} with torch {torch.__version__}). "
            f"{torch_equivalent(algorithm)} See docs/bagua.md.") from error


@dataclass(kw_only=True)
class BaguaFit(Fit):
    """A Bagua fit: its net is the one Bagua hooked into; whether its asynchronous averaging is aborted for an
    evaluation."""

    paused: bool = False


class BaguaStrategy(ParallelStrategy):
    """Bagua data parallel. `algorithm` is one of ALGORITHMS; its options (e.g. `sync_interval_ms=100` for
    "async", `communication_interval=2` for "decentralized") are passed to Bagua's algorithm class. "qadam" needs the
    Model's optimizer to be `bagua.torch_api.algorithms.q_adam.QAdamOptimizer(params, lr=..., warmup_steps=...)`."""

    name = "bagua"

    def __init__(self, algorithm: str = "gradient_allreduce", *, accelerator: str | None = None,
                 parallel_devices: list[torch.device] | None = None, num_nodes: int | None = None,
                 environment: ClusterEnvironment | None = None, timeout: timedelta = DEFAULT_TIMEOUT, **options):
        if algorithm not in ALGORITHMS:
            raise ValueError(f"Bagua algorithm must be one of {', '.join(ALGORITHMS)}; received {algorithm!r}")
        unknown = sorted(set(options) - set(ALGORITHMS[algorithm].options))
        if unknown:
            raise ValueError(f"Bagua's {algorithm!r} algorithm takes {', '.join(ALGORITHMS[algorithm].options)}; "
                             f"received {', '.join(unknown)}")
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices, num_nodes=num_nodes,
                         environment=environment, process_group_backend="nccl", timeout=timeout)
        self.algorithm, self.algorithm_options = algorithm, options
        import_bagua(algorithm)   # fail here, before any process starts, with the explanation and the alternative

    def check_call(self, call) -> None:
        if call.accelerator != "cuda":
            raise ValueError(f"Bagua runs on CUDA GPUs only (NCCL); this call asks for accelerator="
                             f"{call.accelerator!r}. {torch_equivalent(self.algorithm)}")

    def make_launcher(self):
        """Under `python -m bagua.distributed.launch` / `baguarun` the ranks exist; from a plain script with
        devices=N, easyfit re-runs the script, as for "ddp", and each re-run rank does the ready handshake."""
        from easyfit.distributed import launchers
        if self.environment.creates_processes_externally:
            return launchers.existing_rank_launcher(self.environment)
        return launchers.ScriptLauncher(self) if self.num_processes > 1 else None

    def join_process_group(self, call) -> None:
        """Join Bagua's process group (it also creates torch's, over NCCL, which easyfit's collectives use); this
        rank's GPU is selected already."""
        bagua = import_bagua(self.algorithm)
        if bagua.communication.is_initialized():
            return
        store = dist.TCPStore(self.environment.main_address, self.environment.main_port, self.world_size,
                              self.global_rank == 0, timeout=self.timeout)
        bagua.init_process_group(store, rank=self.global_rank, world_size=self.world_size,
                                 local_world_size=self.num_processes)

    def setup(self, net: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler=None, settings=None,
              call=None) -> BaguaFit:
        """`net.with_bagua([optimizer], algorithm)`: Bagua hooks into the net and the optimizer in place."""
        net = Strategy.setup(self, net, optimizer, scheduler, settings, call).net
        net = net.with_bagua([optimizer], self._make_algorithm(optimizer))
        return BaguaFit(strategy=self, net=net, optimizer=optimizer, scheduler=scheduler, call=call)

    def _make_algorithm(self, optimizer: torch.optim.Optimizer):
        spec = ALGORITHMS[self.algorithm]
        module = importlib.import_module(f"bagua.torch_api.algorithms.{spec.module}")
        if self.algorithm != "qadam":
            return getattr(module, spec.cls)(**self.algorithm_options)
        if not isinstance(optimizer, module.QAdamOptimizer):
            raise ValueError("Bagua's 'qadam' algorithm needs the Model's optimizer to be QAdamOptimizer; received "
                             f"{type(optimizer).__name__}. Use `from bagua.torch_api.algorithms.q_adam import "
                             "QAdamOptimizer` and Model(..., optimizer=QAdamOptimizer(net.parameters(), lr=0.05, "
                             "warmup_steps=100)).")
        return module.QAdamAlgorithm(optimizer, **self.algorithm_options)

    def no_sync(self, fit: Fit) -> contextlib.AbstractContextManager:
        net = fit.net
        return _without_gradient_sync(net.bagua_ddp) if hasattr(net, "bagua_ddp") else contextlib.nullcontext()

    # --- the asynchronous algorithm pauses around evaluation -----------------------
    def module_for_eval(self, fit: Fit) -> torch.nn.Module:
        """Stop background averaging while evaluating in a fit, so every rank evaluates fixed weights (after the fit
        it is stopped already: `end_fit`)."""
        if self.algorithm == "async" and isinstance(fit, BaguaFit) and not fit.paused:
            fit.net.bagua_algorithm.abort(fit.net)
            fit.paused = True
        return super().module_for_eval(fit)

    def zero_grad(self, fit: BaguaFit) -> None:
        """The first step after an evaluation resumes the background averaging."""
        if fit.paused:
            fit.net.bagua_algorithm.resume(fit.net)
            fit.paused = False
        super().zero_grad(fit)

    def end_fit(self, fit: BaguaFit, user_net, user_optimizer) -> None:
        """The fit ended: stop the background averaging (Bagua asks for abort after training)."""
        if self.algorithm == "async" and not fit.paused:
            fit.net.bagua_algorithm.abort(fit.net)
        super().end_fit(fit, user_net, user_optimizer)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(algorithm={self.algorithm!r}, options={self.algorithm_options})"


@contextlib.contextmanager
def _without_gradient_sync(bagua_ddp):
    """Bagua's own switch for an accumulation micro-step: its backward hooks do nothing while it is off."""
    bagua_ddp.require_backward_grad_sync = False
    try:
        yield
    finally:
        bagua_ddp.require_backward_grad_sync = True
