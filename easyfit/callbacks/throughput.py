"""ThroughputMonitor: how fast the fit trains, in samples and FLOPs per second and as a share of the devices' peak.

The FLOPs of a training step are counted once, on the first batch, with `torch.utils.flop_counter` (forward and
backward of the ops it knows); the peak is the device's dense peak for the fit's precision (`PEAKS`, from the
vendors' data sheets) or `peak_flops=`."""
from __future__ import annotations

import time

import torch

from easyfit.callbacks.base import Callback

#: dense peak FLOP/s of common GPUs by the compute type: fp32 (plain), tf32 (fp32 matmuls on tensor cores, when
#: torch allows them), bf16 and fp16; the first entry whose words all appear in the device's name applies
PEAKS = (
    (("h200",), {"fp32": 66.9e12, "tf32": 494.7e12, "bf16": 989.4e12, "fp16": 989.4e12}),
    (("h100", "pcie"), {"fp32": 51.2e12, "tf32": 378e12, "bf16": 756e12, "fp16": 756e12}),
    (("h100",), {"fp32": 66.9e12, "tf32": 494.7e12, "bf16": 989.4e12, "fp16": 989.4e12}),
    (("b200",), {"fp32": 80e12, "tf32": 1100e12, "bf16": 2250e12, "fp16": 2250e12}),
    (("a100",), {"fp32": 19.5e12, "tf32": 156e12, "bf16": 312e12, "fp16": 312e12}),
    (("l40s",), {"fp32": 91.6e12, "tf32": 183e12, "bf16": 362e12, "fp16": 362e12}),
    (("l40",), {"fp32": 90.5e12, "tf32": 90.5e12, "bf16": 181e12, "fp16": 181e12}),
    (("l4",), {"fp32": 30.3e12, "tf32": 60e12, "bf16": 121e12, "fp16": 121e12}),
    (("a10",), {"fp32": 31.2e12, "tf32": 62.5e12, "bf16": 125e12, "fp16": 125e12}),
    (("rtx", "4090"), {"fp32": 82.6e12, "tf32": 82.6e12, "bf16": 165.2e12, "fp16": 165.2e12}),
    (("rtx", "3090"), {"fp32": 35.6e12, "tf32": 35.6e12, "bf16": 71e12, "fp16": 71e12}),
    (("a6000",), {"fp32": 38.7e12, "tf32": 77.4e12, "bf16": 154.8e12, "fp16": 154.8e12}),
    (("v100",), {"fp32": 15.7e12, "fp16": 125e12}),
    (("t4",), {"fp32": 8.1e12, "fp16": 65e12}),
)


def peak_flops(device: torch.device, precision: str) -> float | None:
    """The dense peak FLOP/s of one `device` for a fit in `precision` ("32", "bf16-mixed", ...), or None when the
    table does not know it (a CPU, an unlisted GPU, a compute type it lacks)."""
    if device.type != "cuda":
        return None
    return lookup_peak(torch.cuda.get_device_name(device), precision, torch.backends.cuda.matmul.allow_tf32)


def lookup_peak(name: str, precision: str, tf32: bool) -> float | None:
    """`PEAKS`' figure for a GPU named `name` computing in `precision` (fp32 matmuls on tensor cores with `tf32`)."""
    kind = "bf16" if "bf16" in precision else "fp16" if "16" in precision else "tf32" if tf32 else "fp32"
    for words, peaks in PEAKS:
        if all(word in name.lower() for word in words):
            return peaks.get(kind)
    return None


class ThroughputMonitor(Callback):
    """Adds to each epoch's logs, for the whole job (every process together): `samples_per_second` (training
    samples over the epoch's training time, validation excluded; the fit's first step, whose FLOPs are counted, is
    not timed) and `step_time` (seconds per training batch); where the FLOPs of a step can be counted,
    `flops_per_second` and `mfu` (the share of the devices' peak: per device from `PEAKS` or `peak_flops`, times
    the number of processes; no `mfu` on a CPU without `peak_flops`).

    Args:
        peak_flops: the peak FLOP/s of one device, to override the table (or to get `mfu` on a CPU).
        count_flops: count a step's FLOPs on the first batch (default True).
    """

    may_stop_training = False
    runs_first = True   # the values it adds reach the History, the display and the loggers

    def __init__(self, peak_flops: float | None = None, count_flops: bool = True):
        if peak_flops is not None and (isinstance(peak_flops, bool) or not isinstance(peak_flops, (int, float))
                                       or peak_flops <= 0):
            raise ValueError(f"ThroughputMonitor: peak_flops must be a positive number of FLOP/s per device, e.g. "
                             f"989e12, or None, got {peak_flops!r}")
        self.peak_flops, self.count_flops = peak_flops, count_flops
        self.flops_per_sample: float | None = None
        self.counting = False
        self.counter = None   # torch.utils.flop_counter.FlopCounterMode, around the counted step
        self.started: float | None = None   # when the epoch's first training batch began
        self.ended: float | None = None     # when its training ended
        self.samples = self.batches = 0

    def on_train_begin(self, logs=None):
        if self.counter is not None:   # an attempt that failed in its first step left it counting
            self.counter.__exit__(None, None, None)
        self.flops_per_sample, self.counting, self.counter = None, self.count_flops, None

    def on_epoch_begin(self, epoch, logs=None):
        self.started = self.ended = None
        self.samples = self.batches = 0

    def on_train_batch_begin(self, batch, logs=None):
        if self.started is None:
            self._synchronize()
            self.started = time.perf_counter()
        if self.counting:   # the first step of the fit: count its FLOPs
            from torch.utils.flop_counter import FlopCounterMode
            self.counter = FlopCounterMode(display=False)
            self.counter.__enter__()

    def on_train_batch_end(self, batch, logs=None):
        size = logs["size"]
        if self.counter is not None:
            self.counter.__exit__(None, None, None)
            flops = self.counter.get_total_flops()
            self.flops_per_sample = flops / size if flops else None
            self.counter, self.counting = None, False
            self._synchronize()
            self.started = time.perf_counter()   # the counted step, slowed by the counting, is not timed
            return
        self.samples += size
        self.batches += 1

    def on_test_begin(self, logs=None):
        self._end_training()   # validation follows: it is not timed

    def on_epoch_end(self, epoch, logs=None):
        if self.started is None or logs is None:
            return
        self._end_training()
        strategy = self.model.strategy
        device, elapsed = strategy.root_device, self.ended - self.started
        flops = (self.flops_per_sample or 0.0) * self.samples
        totals = torch.tensor([self.samples, self.batches, flops], dtype=torch.float64, device=device)
        samples, batches, flops = strategy.reduce(totals, "sum").tolist()
        elapsed = strategy.reduce(torch.tensor([elapsed], dtype=torch.float64, device=device), "max").item()
        if not batches or elapsed <= 0:   # an epoch of one batch, the one whose FLOPs were counted
            return
        logs["samples_per_second"] = samples / elapsed
        logs["step_time"] = elapsed / (batches / strategy.world_size)
        if self.flops_per_sample:
            logs["flops_per_second"] = flops / elapsed
            peak = self.peak_flops or peak_flops(device, self.params.get("precision", "32"))
            if peak:
                logs["mfu"] = flops / elapsed / (peak * strategy.world_size)

    def _end_training(self) -> None:
        if self.started is not None and self.ended is None:
            self._synchronize()
            self.ended = time.perf_counter()

    def _synchronize(self) -> None:
        device = self.model.strategy.root_device
        if device.type == "cuda":
            torch.cuda.synchronize(device)
