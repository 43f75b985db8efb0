"""The served core's trace window (`PAGODA_CORE_TRACE`) and the summary that reads it: the window records the steps
it names, and the summary's busy share, gaps and attributions match a trace whose answers are known by hand."""

import gzip
import json
import os
import sys

import pytest
import torch

from pagoda.engine.core_trace import TraceWindow, traced
from pagoda.errors import ConfigError

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "profile"))
import core_trace_summary as cts  # noqa: E402


def test_the_window_spec():
    assert TraceWindow.parse("/tmp/t.json") == TraceWindow("/tmp/t.json", 300, 200)
    assert TraceWindow.parse("/tmp/t.json.gz,10,5") == TraceWindow("/tmp/t.json.gz", 10, 5)
    for bad in ("", ",1", "/tmp/t,x", "/tmp/t,1,0", "/tmp/t,-1", "/tmp/t,1,2,3"):
        with pytest.raises(ConfigError, match="PAGODA_CORE_TRACE"):
            TraceWindow.parse(bad)


def test_unset_is_no_profiler():
    with traced(None) as tick:
        assert tick is None


def test_the_window_records_the_steps_it_names(tmp_path):
    path = str(tmp_path / "core.json.gz")
    x = torch.randn(64, 64)
    with traced(f"{path},3,4") as tick:
        for _ in range(12):
            x = torch.tanh(x @ x) / 8
            tick()
    with gzip.open(path, "rt") as f:
        events = json.load(f)["traceEvents"]
    steps = [e for e in events if cts.STEP.fullmatch(e.get("name", ""))]
    assert len(steps) == 4
    assert any(e.get("name") == "aten::mm" for e in events)
    summary = cts.summarize(cts.load(path))
    assert summary["steps"] == 4 and summary["gpu_busy_pct"] == 0.0  # no GPU here: the whole window idle


def test_a_window_cut_short_by_shutdown_is_still_written(tmp_path):
    path = str(tmp_path / "core.json")
    with traced(f"{path},1,50") as tick:
        for _ in range(5):
            torch.ones(8).sum()
            tick()
    assert os.path.getsize(path) > 0


def _x(name, cat, ts, dur, tid=1, **args):
    return {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur, "pid": 1, "tid": tid, "args": args}


def test_the_summary_of_a_known_trace(tmp_path):
    # Step 1 [0, 1000): launches a decode kernel at 100 (runs 200-700); then a sync inside aten::item 700-900.
    # Step 2 [1000, 3000): launches the tower's attention at 1100 (runs 1500-2500); Python until 3000.
    events = [
        _x("ProfilerStep#1", "user_annotation", 0, 1000),
        _x("ProfilerStep#2", "user_annotation", 1000, 2000),
        _x("cudaLaunchKernel", "cuda_runtime", 100, 10, correlation=1),
        _x("aten::item", "cpu_op", 650, 300),
        _x("aten::_local_scalar_dense", "cpu_op", 660, 280),  # inside aten::item: not counted again
        _x("cudaMemcpyAsync", "cuda_runtime", 700, 200, correlation=2),
        _x("cudaLaunchKernel", "cuda_runtime", 1100, 10, correlation=3),
        _x("decode_kernel", "kernel", 200, 500, tid=7, correlation=1),
        _x("Memcpy DtoH", "gpu_memcpy", 880, 10, tid=7, correlation=2),
        _x("cudnn_sdpa_fprop", "kernel", 1500, 1000, tid=7, correlation=3),
    ]
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"traceEvents": events}))
    s = cts.summarize(cts.load(str(path)), gap_ms=0.15)
    assert s["window_ms"] == 3.0 and s["steps"] == 2
    assert s["gpu_busy_pct"] == pytest.approx(100 * 1510 / 3000)
    # idle: [0,200) [700,880) [890,1500) [2500,3000): 0.2, 0.18, 0.61, 0.5 ms
    assert s["gaps"][">= 0.05 ms"] == {"count": 4, "ms": pytest.approx(1.49)}
    assert s["gaps"][">= 0.2 ms"] == {"count": 3, "ms": pytest.approx(1.31)}
    assert s["gaps"][">= 1.0 ms"]["count"] == 0
    assert s["long_gaps"] == {"min_ms": 0.15, "count": 4, "ms": pytest.approx(1.49)}
    host = s["host_in_long_gaps"]
    assert host["runtime: cudaMemcpyAsync"] == pytest.approx(0.18 + 0.01)  # [700,880) and [890,900)
    assert host["op: aten::item"] == pytest.approx(0.18 + 0.06)  # [700,880) and [890,950)
    assert "op: aten::_local_scalar_dense" not in host
    assert host["runtime: cudaLaunchKernel"] == pytest.approx(0.01 + 0.01)  # [100,110) and [1100,1110)
    assert host["outside any operator or runtime call"] == pytest.approx(1.49 - 0.01 - 0.18 - 0.06 - 0.01)
    assert s["longest_gaps"] == [
        # [890, 1500): aten::item overlaps it 60 µs, the copy and the launch 10 each
        {"at_ms": 0.89, "ms": pytest.approx(0.61), "step": "ProfilerStep#1", "host_call": "aten::item"},
        {"at_ms": 2.5, "ms": 0.5, "step": "ProfilerStep#2", "host_call": None},
        {"at_ms": 0.0, "ms": 0.2, "step": "ProfilerStep#1", "host_call": "cudaLaunchKernel"},
        # [700, 880): aten::item and the copy both cover it; operators are listed before runtime calls
        {"at_ms": 0.7, "ms": pytest.approx(0.18), "step": "ProfilerStep#1", "host_call": "aten::item"},
    ]
    kinds = s["step_kinds"]
    assert kinds["decode/prefill"] == {"steps": 1, "cpu_ms_mean": 1.0, "gpu_busy_ms_mean": 0.51}
    assert kinds["image"] == {"steps": 1, "cpu_ms_mean": 2.0, "gpu_busy_ms_mean": 1.0}
