"""Profiler: torch.profiler over chosen training steps, a trace per rank and a table of the slowest ops."""
from __future__ import annotations

import os

from easyfit.callbacks.base import Callback
from easyfit.utils.checks import check_non_negative_int, check_positive_int


class Profiler(Callback):
    """Profile the fit's training steps with `torch.profiler`: skip `wait` steps, warm up for `warmup`, record
    `active` (counted from the fit's first step, once). Each rank writes its trace to `output`
    (`rank<N>.<time>.pt.trace.json`: `tensorboard --logdir <output>` with the torch-tb-profiler plugin and
    chrome://tracing / Perfetto open it); rank 0 prints the `row_limit` slowest ops (by self time) when recording
    ends, and keeps the table in `summary`.

    Args:
        wait, warmup, active: the profiler's schedule, in training steps (defaults 1, 1, 3).
        output: the folder of the traces (default "profile/").
        row_limit: rows of the summary table (default 15).
        record_shapes, profile_memory, with_stack: as torch.profiler.profile takes them (default False).
    """

    may_stop_training = False

    def __init__(self, wait: int = 1, warmup: int = 1, active: int = 3, output: str | os.PathLike = "profile/",
                 row_limit: int = 15, record_shapes: bool = False, profile_memory: bool = False,
                 with_stack: bool = False):
        for name, value in (("wait", wait), ("warmup", warmup)):
            check_non_negative_int(value, f"Profiler: {name}", "a number of steps >= 0")
        check_positive_int(active, "Profiler: active")
        check_positive_int(row_limit, "Profiler: row_limit")
        self.wait, self.warmup, self.active, self.output = wait, warmup, active, os.fspath(output)
        self.row_limit = row_limit
        self.options = {"record_shapes": record_shapes, "profile_memory": profile_memory, "with_stack": with_stack}
        self.profiler = None
        self.steps = 0
        self.summary: str | None = None
        self.trace: str | None = None   # this rank's trace file

    def on_train_begin(self, logs=None):
        from torch.profiler import ProfilerActivity, profile, schedule, tensorboard_trace_handler
        activities = [ProfilerActivity.CPU]
        if self.model.strategy.root_device.type == "cuda":
            activities.append(ProfilerActivity.CUDA)
        self._stop()   # one an attempt that failed left running
        worker = f"rank{self.model.global_rank}"
        handler = tensorboard_trace_handler(self.output, worker_name=worker)
        self.steps, self.summary, self.trace = 0, None, None
        self.profiler = profile(activities=activities, on_trace_ready=lambda prof: self._ready(prof, handler, worker),
                                schedule=schedule(wait=self.wait, warmup=self.warmup, active=self.active, repeat=1),
                                **self.options)
        self.profiler.start()

    def _ready(self, profiler, handler, worker: str) -> None:
        def own_traces() -> set:   # the other ranks write theirs into the same folder meanwhile
            names = os.listdir(self.output) if os.path.isdir(self.output) else []
            return {name for name in names if name.startswith(worker + ".") and name.endswith(".pt.trace.json")}
        before = own_traces()
        handler(profiler)
        written = sorted(own_traces() - before)
        self.trace = os.path.join(self.output, written[0]) if written else None
        if self.model.is_global_zero:
            cuda = self.model.strategy.root_device.type == "cuda"
            self.summary = profiler.key_averages().table(
                sort_by="self_cuda_time_total" if cuda else "self_cpu_time_total", row_limit=self.row_limit)
            print(self.summary, flush=True)

    def on_train_batch_end(self, batch, logs=None):
        if self.profiler is None:
            return
        self.profiler.step()
        self.steps += 1
        if self.steps >= self.wait + self.warmup + self.active:   # recorded: the rest of the fit runs unprofiled
            self._stop()

    def on_train_end(self, logs=None):
        self._stop()

    def _stop(self) -> None:
        if self.profiler is not None:
            profiler, self.profiler = self.profiler, None
            profiler.stop()
