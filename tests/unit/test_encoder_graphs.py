"""Which of the vision encoder's forwards are captured in CUDA graphs (`pagoda/worker/encoder_graphs.py`); the
replays themselves are tested against eager forwards on a GPU (tests/kernels/test_encoder_graph_replays.py)."""

from __future__ import annotations

import contextlib
import gc

import pytest
import torch

from pagoda.worker.encoder_graphs import CapturePolicy
from pagoda.worker.graph_runner import capture_graph, gc_paused

A = ((1, 4, 4),)
B = ((1, 4, 6),)


def test_a_key_is_captured_on_its_third_sighting_and_then_no_longer_counted():
    policy = CapturePolicy(max_patches=64)
    assert [policy.should_capture(A, 16) for _ in range(3)] == [False, False, True]
    policy.did_capture(A)
    assert policy.captured == 1
    assert [policy.should_capture(B, 24) for _ in range(2)] == [False, False]  # B counts on its own


def test_forwards_beyond_the_patch_cap_or_the_graph_count_stay_eager():
    policy = CapturePolicy(max_patches=20, after=1, max_graphs=1)
    assert not policy.should_capture(B, 24)  # 24 rows > 20
    assert policy.should_capture(A, 16)
    policy.did_capture(A)
    assert not policy.should_capture(((1, 2, 2),), 4)  # one graph held already


def test_after_one_captures_at_first_sight():
    assert CapturePolicy(max_patches=16, after=1).should_capture(A, 16)


class _Recorder:
    """Stands in for the CUDA calls a capture makes (this machine has no GPU): records them in order."""

    def __init__(self, monkeypatch):
        self.calls: list[str] = []
        rec = self

        class Graph:
            def capture_begin(self, pool=None, capture_error_mode="global"):
                rec.calls.append(f"begin:{pool}:{capture_error_mode}")

            def capture_end(self):
                rec.calls.append("end")

        @contextlib.contextmanager
        def on_stream(stream):
            rec.calls.append(f"stream:{stream}")
            yield

        monkeypatch.setattr(torch.cuda, "CUDAGraph", Graph)
        monkeypatch.setattr(torch.cuda, "stream", on_stream)
        monkeypatch.setattr(torch.cuda, "graph", lambda *a, **k: rec.calls.append("torch.cuda.graph") or on_stream(0))
        monkeypatch.setattr(torch.cuda, "empty_cache", lambda: rec.calls.append("empty_cache"))
        monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: rec.calls.append("synchronize"))
        monkeypatch.setattr(gc, "collect", lambda *a: rec.calls.append("gc.collect") or 0)


def test_a_capture_while_serving_leaves_the_allocator_caches_and_the_heap_alone(monkeypatch):
    # torch.cuda.graph empties the device and pinned-host caches and syncs first: mid-serving that stall falls on
    # the request whose forward is captured, so the encoder captures through capture_begin/end on its stream.
    rec = _Recorder(monkeypatch)
    with gc_paused(collect=False):
        assert not gc.isenabled()
        graph, out = capture_graph(lambda: rec.calls.append("run") or 7, "pool", "side", while_serving=True)
    assert out == 7 and gc.isenabled()
    assert rec.calls == ["stream:side", "begin:pool:thread_local", "run", "end"]


def test_a_failed_capture_while_serving_still_ends_the_capture(monkeypatch):
    rec = _Recorder(monkeypatch)

    def fails():
        raise RuntimeError("operation not permitted when stream is capturing")

    with pytest.raises(RuntimeError, match="capturing"):
        capture_graph(fails, "pool", "side", while_serving=True)
    assert rec.calls[-1] == "end"  # the stream is not left capturing


def test_a_startup_capture_goes_through_torch_cuda_graph_after_a_collection(monkeypatch):
    rec = _Recorder(monkeypatch)
    with gc_paused():
        capture_graph(lambda: None, "pool", "side")
    assert rec.calls == ["gc.collect", "torch.cuda.graph", "stream:0"]
