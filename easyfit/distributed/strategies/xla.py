"""TPUs through torch_xla ("xla", and what accelerator="tpu" chooses): one XLA device per process.

The device comes from `torch_xla.device()`; batches reach it through torch_xla's parallel loader (`MpDeviceLoader`),
whose step to the next batch cuts the traced graph (`torch_xla.sync()`), so one compiled graph serves every step of
the same shape. `xm.optimizer_step` all-reduces the gradients over the replicas before the optimizer steps.
Several devices run as torch_xla runs them: `torch_xla.launch` starts one process per TPU chip (see
launchers/xla.py); rank and world size come from `torch_xla.runtime`, collectives are XLA's. Nothing here reads a
value back to the host during a step; states for checkpoints are copied to CPU tensors, so a plain CPU net loads
them. torch_xla is imported only when this strategy is built, after `require_torch_xla` checked it.
"""
from __future__ import annotations

import copy
import functools
import importlib.metadata
import os
from collections import defaultdict
from dataclasses import dataclass, replace

import torch

from easyfit.data.contents import move_to_device
from easyfit.distributed.collectives import XlaCollectives
from easyfit.distributed.strategies.base import CallState, Strategy
from easyfit.distributed.strategies.capabilities import Capabilities
from easyfit.distributed.strategies.states import NOT_LAUNCHED, Fit, Launched
from easyfit.parts.optimizers import align_state
from easyfit.parts.precision import Precision
from easyfit.saving.checkpoint import load_checkpoint_file
from easyfit.utils.tensors import map_tensors

#: the torch_xla release `pip install easyfit[xla]` installs; it pins torch to the same version
TORCH_XLA_VERSION = "2.9.0"
XLA_RNG_KEY = "xla_rng"   # the checkpoint's entry for the XLA device's random seed (dropout on the device)
CPU = torch.device("cpu")


def _minor(version: str) -> str:
    return ".".join(version.split("+")[0].split(".")[:2])


def require_torch_xla() -> None:
    """Raise, in words, when torch_xla is missing or was built for another torch (checked from the installed
    packages' versions, before importing torch_xla, which would fail with undefined symbols)."""
    try:
        version = importlib.metadata.version("torch_xla")
    except importlib.metadata.PackageNotFoundError:
        raise ImportError(
            f"accelerator='tpu' / strategy='xla' needs torch_xla, which is not installed (torch here is "
            f"{torch.__version__}). Install it with the torch it pins: pip install 'easyfit[xla]' (torch_xla "
            f"{TORCH_XLA_VERSION}, which requires torch {_minor(TORCH_XLA_VERSION)}; use a separate virtual "
            f"environment if this one needs another torch), and on a TPU VM pip install "
            f"'torch_xla[tpu]=={TORCH_XLA_VERSION}' for the TPU runtime. See docs/tpu.md.") from None
    if _minor(version) != _minor(torch.__version__):
        raise RuntimeError(
            f"torch_xla {version} works only with torch {_minor(version)}, but torch {torch.__version__} is "
            f"installed. Install the matching pair: pip install 'easyfit[xla]' (torch_xla {TORCH_XLA_VERSION} with "
            f"torch {TORCH_XLA_VERSION}), or the torch_xla release of your torch. See docs/tpu.md.")


def on_xla_cpu() -> bool:
    """True when torch_xla's device is XLA:CPU (PJRT_DEVICE=CPU), where the tests run."""
    return os.environ.get("PJRT_DEVICE", "").upper() == "CPU"


@dataclass
class XLACall(CallState):
    """An XLA call in the process that holds the device (from `setup_environment`): evaluate's or predict's (net, its
    copy on the device)."""

    eval_copy: tuple[torch.nn.Module, torch.nn.Module] | None = None


@dataclass(kw_only=True)
class XLAFit(Fit):
    """An XLA fit: its net and optimizer are trained in place on the device (brought back to the CPU at its end);
    whether this step's gradients were averaged already (before clipping)."""

    reduced: bool = False


class XLAStrategy(Strategy):
    """One XLA device in this process (devices=1), or one process per device of this host (torch_xla.launch)."""

    name = "xla"
    #: xm.optimizer_step reduces the gradients; graphs are compiled per shape, so each step's loss is summed at once
    capabilities = Capabilities(plain_optimizer_step=False, uses_launcher_processes=False, sums_losses_per_step=True)

    def __init__(self):
        require_torch_xla()
        self.all_devices = False   # launch one process per device of this host (set by configure)
        self.holds_device = False   # this process holds an XLA device (set by configure, or `configure_rank`)
        self.device_count: int | None = None   # the number of devices the call asked for (None: every one)

    def configure(self, accelerator: str = "tpu", parallel_devices: list[torch.device] | None = None,
                  num_nodes: int = 1, environment=None, process_group_backend: str | None = None) -> None:
        """`parallel_devices` from the connector: [xla:0] for one device, [xla:0 .. xla:N-1] for N, [xla] (no
        index) for every device of this host."""
        devices = parallel_devices or [torch.device("xla", 0)]
        self.all_devices = len(devices) > 1 or devices[0].index is None
        self.device_count = None if devices[0].index is None else len(devices)
        self.holds_device = not self.all_devices   # else each replica holds one (`configure_rank`)
        self.capabilities = replace(self.capabilities, starts_processes=self.all_devices)

    # --- what the connector checks ------------------------------------------------------
    def check_call(self, call) -> None:
        if call.num_nodes > 1:
            raise ValueError("strategy='xla' takes the hosts of a TPU pod from torch_xla, not from num_nodes: start "
                             "the script on every host (gcloud compute tpus tpu-vm ssh ... --worker=all, see "
                             "docs/tpu.md) and leave num_nodes=1")
        if call.external:
            raise ValueError(f"strategy='xla' starts its processes through torch_xla, but this process was started "
                             f"by {call.environment.name}. Run the script with plain python on each TPU host.")
        every = call.devices[0].index is None   # every device of this host: CPU_NUM_DEVICES of them on XLA:CPU
        if on_xla_cpu() and (int(os.environ.get("CPU_NUM_DEVICES", "1")) if every else len(call.devices)) > 1:
            raise ValueError(
                "several XLA:CPU devices (PJRT_DEVICE=CPU) cannot train: torch_xla "
                f"{importlib.metadata.version('torch_xla')} runs no collective between them (its first all-reduce "
                "waits forever; pytorch/xla issue 9089). Use devices=1 on XLA:CPU; several devices need TPUs.")

    def processes_per_node(self, call) -> None:
        return None

    # --- identity -------------------------------------------------------------------
    def configure_rank(self, local_rank: int) -> None:
        """In a replica torch_xla.launch started, before its call: this process holds its device."""
        self.holds_device = True

    @property
    def root_device(self) -> torch.device:
        """This process's XLA device where it holds one (one device, or a replica of several); else (the caller of
        the replicas) the CPU: asking for the device there would start the XLA runtime in it."""
        return xla_device() if self.holds_device else CPU

    @property
    def world_size(self) -> int:
        return self._runtime().world_size() if self.holds_device else 1

    @property
    def global_rank(self) -> int:
        return self._runtime().global_ordinal() if self.holds_device else 0

    @property
    def local_rank(self) -> int:
        return self._runtime().local_ordinal() if self.holds_device else 0

    @staticmethod
    def _runtime():
        import torch_xla.runtime as xr
        return xr

    def make_launcher(self):
        if not self.all_devices:
            return None
        from easyfit.distributed.launchers.xla import XLALauncher
        return XLALauncher(self)

    # --- life -----------------------------------------------------------------------
    def setup_environment(self, launched: Launched = NOT_LAUNCHED) -> XLACall:
        local = self._runtime().local_device_count() if self.all_devices else 1
        if self.device_count not in (None, local):
            raise ValueError(f"devices={self.device_count}, but torch_xla runs one process per device of this host, "
                             f"which has {local}. Pass devices='auto' (or 1), or limit the devices torch_xla sees "
                             "(TPU_VISIBLE_CHIPS, see docs/tpu.md).")
        return XLACall(launched)

    def check_precision(self, precision: str) -> None:
        if precision == "16-mixed":
            raise ValueError("precision='16-mixed' (float16 with loss scaling) is not supported on XLA devices: "
                             "TPUs compute in bfloat16. Use precision='bf16-mixed' (autocast to bfloat16, no loss "
                             "scaling) or '32'.")

    def setup(self, net: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler=None, settings=None,
              call=None) -> XLAFit:
        move(net, optimizer, self.root_device)
        return XLAFit(strategy=self, net=net, optimizer=optimizer, scheduler=scheduler, call=call)

    def module_for_eval(self, fit: Fit) -> torch.nn.Module:
        """The net itself when it is on the device (validation in fit); else a copy there, made once per call, so
        the user's net and optimizer keep their parameters."""
        net = fit.net
        if all(tensor.device == self.root_device for tensor in _tensors(net)):
            return net
        call = fit.call
        if call.eval_copy is None or call.eval_copy[0] is not net:
            call.eval_copy = (net, copy.deepcopy(net).to(self.root_device))
        return call.eval_copy[1]

    def end_fit(self, fit: Fit, user_net: torch.nn.Module, user_optimizer: torch.optim.Optimizer) -> None:
        """The trained net and its optimizer's state back on the CPU (they were trained in place): what fit hands
        back to the caller and what `model.save` writes after it are plain CPU tensors, as before the call."""
        self.abandon_fit(fit)
        from easyfit.distributed.strategy_parts.buffers import share_rank_zero_buffers
        share_rank_zero_buffers(self, user_net)   # the same net on every replica (see ParallelStrategy.end_fit)
        super().end_fit(fit, user_net, user_optimizer)

    def abandon_fit(self, fit: Fit) -> None:
        """A fit that failed leaves the net and its optimizer's state on the CPU too."""
        move(fit.net, fit.optimizer, CPU)

    # --- data -----------------------------------------------------------------------
    @property
    def batch_device(self) -> torch.device:
        return CPU   # the parallel loader puts each batch on the device

    def feed(self, batches):
        """The first batch moved here at once, the rest through the parallel loader, which reads ahead: started
        after the loop's first step, which may change how the source makes the batches (labels of shape (N, 1)
        flattened, integer inputs made floats), so none is read ahead in the old form."""
        from torch_xla.distributed.parallel_loader import MpDeviceLoader
        iterator = iter(batches)
        for first in iterator:
            yield move_to_device(first, self.root_device)
            yield from MpDeviceLoader(iterator, self.root_device)

    # --- state ----------------------------------------------------------------------
    def module_state(self, fit: Fit) -> dict:
        return _to_cpu(super().module_state(fit))

    def optimizer_state(self, fit: Fit) -> dict:
        return _to_cpu(super().optimizer_state(fit))

    def device_rng_state(self) -> dict:
        """The XLA device's random seed, while this process holds the device (not in a caller whose ranks
        torch_xla.launch started: asking there would start the XLA runtime in it)."""
        if not self.holds_device:
            return {}
        import torch_xla.core.xla_model as xm
        return {XLA_RNG_KEY: int(xm.get_rng_state(self.root_device))}

    def load_device_rng_state(self, state: dict) -> None:
        if state.get(XLA_RNG_KEY) is not None and self.holds_device:
            import torch_xla.core.xla_model as xm
            xm.set_rng_state(int(state[XLA_RNG_KEY]), self.root_device)

    def load_checkpoint(self, fit: Fit, path: str) -> dict:
        return load_checkpoint_file(path, map_location=CPU)

    # --- step -----------------------------------------------------------------------
    def clip_gradients(self, fit: XLAFit, max_norm: float, precision: Precision) -> None:
        """Clipped after the replicas' gradients are averaged, as DDP clips."""
        import torch_xla.core.xla_model as xm
        xm.reduce_gradients(fit.optimizer)
        super().clip_gradients(fit, max_norm, precision)
        fit.reduced = True

    def optimizer_step(self, fit: XLAFit, precision: Precision) -> None:
        """The replicas' gradients averaged, then the optimizer's step (the parallel loader syncs the graph)."""
        import torch_xla.core.xla_model as xm
        if fit.reduced:
            fit.optimizer.step()
        else:
            xm.optimizer_step(fit.optimizer)
        fit.reduced = False

    # --- collectives ----------------------------------------------------------------
    @property
    def collectives(self) -> XlaCollectives:
        return XlaCollectives(self.world_size, self.root_device)

    def __repr__(self) -> str:
        devices = "every device of this host" if self.all_devices else "1 device"
        return f"XLAStrategy({devices}, device={self.root_device})"


@functools.cache
def xla_device() -> torch.device:
    """This process's XLA device (the same for its lifetime)."""
    import torch_xla
    return torch_xla.device()


def move(net: torch.nn.Module, optimizer: torch.optim.Optimizer | None, device: torch.device) -> None:
    """`net.to(device)`, with the optimizer kept on the net's parameters and its state moved with them. Between
    the CPU and an XLA device torch replaces every Parameter object (their tensor types differ), so the optimizer's
    references are renewed by parameter name."""
    names = {id(param): name for name, param in net.named_parameters()}
    net.to(device)
    if optimizer is None:
        return
    moved = dict(net.named_parameters())
    renew = {param_id: moved[name] for param_id, name in names.items()}
    for group in optimizer.param_groups:
        group["params"] = [renew.get(id(param), param) for param in group["params"]]
    optimizer.state = defaultdict(dict, {renew.get(id(param), param): state
                                         for param, state in optimizer.state.items()})
    align_state(optimizer)


def _tensors(net: torch.nn.Module):
    yield from net.parameters()
    yield from net.buffers()


def _to_cpu(state: dict) -> dict:
    """A state dict with every tensor copied to the CPU (what a plain CPU net or optimizer loads)."""
    return map_tensors(lambda tensor: tensor.to(CPU), state)
