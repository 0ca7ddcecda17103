"""Numeric precision: autocast and gradient scaling ("16-mixed", "bf16-mixed"), or full float32 / float64."""
from __future__ import annotations

import contextlib
from typing import Any

import torch

from easyfit.utils.checks import closest_name
from easyfit.utils.tensors import map_tensors

PRECISIONS = ("32", "16-mixed", "bf16-mixed", "64")
ALIASES = {"32-true": "32", "16": "16-mixed", "bf16": "bf16-mixed", "64-true": "64", "double": "64"}


def parse_precision(precision: Any) -> str:
    key = str(precision).lower()
    key = ALIASES.get(key, key)
    if key not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}.{closest_name(key, PRECISIONS)} "
                         f"Valid values: {', '.join(PRECISIONS)}.")
    return key


def cpu_supports_fp16() -> bool:
    """Whether this CPU has native float16 kernels (oneDNN's AVX512-FP16 / AMX-FP16), which DeepSpeed requires for
    fp16 on a CPU; torch's autocast runs float16 on any CPU."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    except (AttributeError, RuntimeError):
        return False


class Precision:
    """What a precision setting changes in the step: input dtype, autocast, and loss scaling."""

    #: the backend casts the net's floating inputs to the dtype it holds the net in: in-memory data stays float32
    casts_inputs = False

    def __init__(self, precision: Any = "32", device: torch.device | None = None):
        self.name = parse_precision(precision)
        self.device = device = device or torch.device("cpu")
        self.autocast_dtype = {"16-mixed": torch.float16, "bf16-mixed": torch.bfloat16}.get(self.name)
        if self.autocast_dtype is not None and not torch.amp.is_autocast_available(device.type):
            raise ValueError(f"precision={self.name!r} needs autocast, which torch does not support on "
                             f"{device.type!r}; use precision='32'")
        self.scaler = torch.amp.GradScaler(device.type) if self.name == "16-mixed" else None

    def for_run(self, precision: Any, device: torch.device) -> Precision:
        """The precision of the next fit / evaluate / predict: `precision`, or this one's setting when None.

        An unchanged setting keeps its loss-scaler state, so evaluating between fits or saving after an
        evaluate loses nothing, and a net fitted in "64" is evaluated in "64"."""
        name = self.name if precision is None else parse_precision(precision)
        if name == self.name and device == self.device:
            return self
        fresh = Precision(name, device)
        if name == self.name:
            fresh.load_state_dict(self.state_dict())
        return fresh

    @property
    def float_dtype(self) -> torch.dtype:
        """The dtype float64 numpy input is read as: float64 under "64", float32 otherwise."""
        return torch.float64 if self.name == "64" else torch.float32

    def convert_module(self, net: torch.nn.Module) -> torch.nn.Module:
        """float64 weights under "64"; float32 otherwise (a net an earlier "64" fit left in float64 comes back)."""
        if self.name == "64":
            return net.double()
        return net.float() if any(p.dtype == torch.float64 for p in net.parameters()) else net

    def convert_input(self, batch: Any) -> Any:
        """Float tensors become float64 under precision "64"; otherwise the batch is returned as is."""
        if self.name != "64":
            return batch
        return map_tensors(lambda tensor: tensor.double() if tensor.is_floating_point() else tensor, batch)

    def autocast(self) -> contextlib.AbstractContextManager:
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    def backward(self, loss: torch.Tensor) -> None:
        (self.scaler.scale(loss) if self.scaler else loss).backward()

    def unscale_gradients(self, optimizer: torch.optim.Optimizer) -> None:
        """Bring gradients to their true scale (before clipping)."""
        if self.scaler:
            self.scaler.unscale_(optimizer)

    def optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        if self.scaler:
            self.scaler.step(optimizer)
            self.scaler.update()
        else:
            optimizer.step()

    def state_dict(self) -> dict:
        return self.scaler.state_dict() if self.scaler else {}

    def load_state_dict(self, state: dict) -> None:
        if self.scaler and state:
            self.scaler.load_state_dict(state)
