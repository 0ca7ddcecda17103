"""ThroughputMonitor and Profiler: the counted FLOPs of a step equal the matmuls' count by hand, the figures are for
the whole job on 2 processes (every rank logs the same), a trace per rank and the slowest ops on rank 0."""
from __future__ import annotations

import json

import pytest
from around_helpers import make_data, make_net

import easyfit
from easyfit.callbacks import Profiler, ThroughputMonitor
from easyfit.callbacks.throughput import lookup_peak

#: make_net (Linear 6-16, Tanh, Linear 16-3) per sample: forward 2·(6·16 + 16·3), the weights' gradients as much
#: again, and the input gradient of the second layer 2·16·3 (the first layer's input needs none)
FLOPS_PER_SAMPLE = 2 * (6 * 16 + 16 * 3) * 2 + 2 * 16 * 3


def fit(callbacks, epochs=2, **options):
    x, y = make_data()
    model = easyfit.Model(make_net(), "cross_entropy", "sgd")
    return model.fit(x, y, batch_size=32, epochs=epochs, verbose=0, callbacks=callbacks, **options)


def test_throughput_counts_the_flops_of_a_step_and_reports_per_epoch():
    history = fit([ThroughputMonitor(peak_flops=1e12)], validation_split=0.25).history
    for epoch in range(2):
        assert history["flops_per_second"][epoch] / history["samples_per_second"][epoch] == \
            pytest.approx(FLOPS_PER_SAMPLE)
        assert history["samples_per_second"][epoch] * history["step_time"][epoch] == pytest.approx(32)
        assert history["mfu"][epoch] == pytest.approx(history["flops_per_second"][epoch] / 1e12)


def test_no_mfu_on_a_cpu_without_a_peak_and_the_table_of_gpus():
    history = fit([ThroughputMonitor()]).history
    assert "flops_per_second" in history and "mfu" not in history
    assert lookup_peak("NVIDIA H100 80GB HBM3", "bf16-mixed", tf32=False) == 989.4e12
    assert lookup_peak("NVIDIA H100 PCIe", "32", tf32=False) == 51.2e12
    assert lookup_peak("NVIDIA A100-SXM4-80GB", "32", tf32=True) == 156e12
    assert lookup_peak("Tesla V100-SXM2-16GB", "bf16-mixed", tf32=False) is None
    assert lookup_peak("Some Future GPU", "32", tf32=False) is None
    with pytest.raises(ValueError, match="peak_flops"):
        ThroughputMonitor(peak_flops=0)


def test_profiler_writes_a_trace_and_the_slowest_ops(tmp_path, capsys):
    profiler = Profiler(wait=1, warmup=1, active=2, output=tmp_path / "profile")
    fit([profiler], epochs=2)
    trace = json.loads(open(profiler.trace).read())
    assert profiler.trace.startswith(str(tmp_path / "profile" / "rank0."))
    assert any(event.get("name") == "aten::addmm" for event in trace["traceEvents"])
    assert sum(1 for event in trace["traceEvents"] if str(event.get("name", "")).startswith("ProfilerStep#")) == 2
    assert "aten::addmm" in profiler.summary and "aten::addmm" in capsys.readouterr().out
    assert profiler.profiler is None   # stopped once the active steps were recorded
    with pytest.raises(ValueError, match="active"):
        Profiler(active=0)


@pytest.mark.timeout(600)
def test_ddp_throughput_is_the_whole_jobs_and_each_rank_traces(ddp_around):
    rank0, rank1 = (result["history"] for result in ddp_around["throughput"])
    assert rank0 == rank1   # the job's figures, the same on every rank
    for epoch in range(2):
        assert rank0["samples_per_second"][epoch] * rank0["step_time"][epoch] == pytest.approx(32)   # 16 × 2
        assert rank0["flops_per_second"][epoch] / rank0["samples_per_second"][epoch] == \
            pytest.approx(FLOPS_PER_SAMPLE)
    first, second = ddp_around["profiler"]
    assert "/rank0." in first["trace"] and "/rank1." in second["trace"]
    assert "c10d::allreduce_" in first["summary"] and second["summary"] is None
