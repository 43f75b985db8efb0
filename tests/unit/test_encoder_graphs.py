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


class _Tower:
    """A stand-in encoder: eager forwards record which backend this thread had pinned (None: the gate's choice)."""

    encoder_dtype = torch.float32

    def __init__(self):
        self.eager: list[object] = []

    def encode(self, pixels, grids):
        from pagoda.layers import segment_attention

        self.eager.append(getattr(segment_attention._PINNED, "cudnn", None))
        return pixels[:, :2] * 2

    def encoder_plan(self, grids, device):
        return ("plan", tuple(grids))


class _Replay:
    def replay(self):
        pass


def _graphs(monkeypatch, capture, background=True, after=1):
    """EncoderGraphs over `_Tower` with the CUDA objects stubbed and `capture(key, plan, shape, ready)` as the
    capture (it runs where the real one would: on the capture thread, or inline)."""
    from pagoda.worker import encoder_graphs as mod

    class Event:
        def record(self):
            pass

    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: "pool")
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(mod.EncoderGraphs, "_capture", lambda self, *a: capture(*a))
    tower = _Tower()
    return mod.EncoderGraphs(tower, torch.device("cpu"), CapturePolicy(max_patches=64, after=after), background), tower


def _fake_graph(shape):
    from pagoda.worker.encoder_graphs import _Graph

    inputs = torch.zeros(shape)
    return _Graph(_Replay(), inputs, torch.full((shape[0], 2), 7.0), "plan")


def test_a_key_on_the_capture_thread_runs_eagerly_on_flash_until_its_graph_is_ready(monkeypatch):
    import threading

    release, seen = threading.Event(), {}

    def capture(key, plan, shape, ready=None):
        seen.update(thread=threading.current_thread().name, plan=plan, ready=ready)
        release.wait(10)
        return _fake_graph(shape)

    graphs, tower = _graphs(monkeypatch, capture)
    pixels = torch.arange(16 * 3, dtype=torch.float32).reshape(16, 3)
    first = graphs.encode(pixels, [(1, 4, 4)])  # hands the key over: this forward is eager
    second = graphs.encode(pixels, [(1, 4, 4)])  # still capturing: eager again
    torch.testing.assert_close(first, pixels[:, :2] * 2)
    torch.testing.assert_close(second, pixels[:, :2] * 2)
    assert tower.eager == [False, False]  # flash pinned on this thread: no cuDNN plan built here meanwhile
    release.set()
    graphs.wait()
    assert len(graphs) == 1 and seen["thread"].startswith("encoder-graphs") and seen["ready"] is not None
    assert seen["plan"] == ("plan", ((1, 4, 4),))  # the plan was made on the engine's thread and handed over
    replayed = graphs.encode(pixels + 1, [(1, 4, 4)])
    assert tower.eager == [False, False]  # no eager forward once the graph serves
    torch.testing.assert_close(replayed, torch.full((16, 2), 7.0))
    torch.testing.assert_close(graphs._graphs[((1, 4, 4),)].inputs, pixels + 1)  # the replay's pixels copied in
    assert graphs.encode(pixels[:12], [(1, 4, 3)]) is not None and tower.eager[-1] is False  # a second key


def test_a_failed_capture_on_the_capture_thread_leaves_the_encoder_eager_and_the_engine_running(monkeypatch, caplog):
    def capture(key, plan, shape, ready=None):
        raise AssertionError("not a RuntimeError either")

    graphs, tower = _graphs(monkeypatch, capture)
    pixels = torch.ones(16, 3)
    graphs.encode(pixels, [(1, 4, 4)])
    graphs.wait()
    assert graphs.policy.max_graphs == 0 and len(graphs) == 0
    assert "runs eagerly from now on" in caplog.text
    torch.testing.assert_close(graphs.encode(pixels, [(1, 4, 4)]), pixels[:, :2] * 2)
    assert tower.eager == [False, None]  # after the failure the gate decides again


def test_inline_captures_replay_in_the_step_that_met_the_key(monkeypatch):
    calls = []

    def capture(key, plan, shape, ready=None):
        calls.append(ready)
        return _fake_graph(shape)

    graphs, tower = _graphs(monkeypatch, capture, background=False, after=2)
    pixels = torch.ones(16, 3)
    graphs.encode(pixels, [(1, 4, 4)])
    assert tower.eager == [None] and calls == []  # the first sighting: eager, the gate's backend
    torch.testing.assert_close(graphs.encode(pixels, [(1, 4, 4)]), torch.full((16, 2), 7.0))
    assert calls == [None] and tower.eager == [None]  # captured inline (no event) and replayed at once


def test_a_pinned_thread_neither_counts_passes_nor_asks_the_gate(monkeypatch):
    from pagoda.layers import segment_attention as sa

    gate = sa.ShapeGate(after=3)
    monkeypatch.setattr(sa, "_GATE", gate)
    monkeypatch.setattr(sa, "_gated", lambda q: True)
    chosen = []
    monkeypatch.setattr(sa, "_attend", lambda q, k, v, cudnn: chosen.append(cudnn) or q)
    q = torch.randn(1, 2, 4, 8)
    with sa.pinned_backend(cudnn=True):
        sa.begin_pass()
        sa.segment_attention(q, q, q)
    assert gate._pass == 0 and gate._seen == {} and chosen[-1] is True
    sa.begin_pass()
    sa.segment_attention(q, q, q)  # unpinned: the gate's first pass of this shape, flash
    assert gate._pass == 1 and chosen[-1] is False
    with sa.pinned_backend(cudnn=False):
        sa.segment_attention(q, q, q)
    assert chosen[-1] is False and gate._seen[next(iter(gate._seen))] == (1, 1)  # not counted again
    assert getattr(sa._PINNED, "cudnn", None) is None  # the block restored this thread's setting
