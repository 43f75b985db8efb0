"""Sampling on the engine's thread while another thread captures a CUDA graph (the vision tower's captures run on
a thread of their own while the engine serves). For the length of a capture torch holds its default CUDA
generator in capture mode, so a draw from it on any other stream raises; the engine's sampled rows must draw from
a generator of their own and go on sampling."""

from __future__ import annotations

import threading

import pytest
import torch

from pagoda.layers.sampler import Sampler, SamplingState
from pagoda.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _capture_in_thread(started: threading.Event, release: threading.Event, errors: list[BaseException]) -> None:
    try:
        static = torch.ones(64, device="cuda")
        stream = torch.cuda.Stream()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(stream):
            graph.capture_begin(capture_error_mode="thread_local")
            try:
                static.mul_(2)
                started.set()
                release.wait(timeout=30)
            finally:
                graph.capture_end()
        graph.replay()
        torch.cuda.synchronize()
    except BaseException as exc:  # reported to the test's thread
        errors.append(exc)
        started.set()


def test_sampled_rows_keep_sampling_while_another_thread_captures() -> None:
    vocab = 1000
    state = SamplingState(capacity=4, vocab_size=vocab, device="cuda", seed=3)
    ids = ["a", "b", "c", "d"]
    for rid in ids:
        state.add(rid, SamplingParams(temperature=0.9, top_p=0.95), [1, 2, 3])
    logits = torch.randn(4, vocab, device="cuda")

    started, release, errors = threading.Event(), threading.Event(), []
    thread = threading.Thread(target=_capture_in_thread, args=(started, release, errors))
    thread.start()
    try:
        assert started.wait(timeout=30)
        assert not errors, errors
        # The condition is real: torch's default generator refuses a draw outside the capture.
        with pytest.raises(RuntimeError):
            torch.empty(8, device="cuda").exponential_()
        for _ in range(3):
            out = Sampler()(logits, state.batch(ids))
            state.update(out.sampled_token_ids)
        tokens = out.sampled_token_ids.tolist()  # waits for the engine's stream only, as the engine does
        assert len(tokens) == 4 and all(0 <= t < vocab for t in tokens)
    finally:
        release.set()
        thread.join(timeout=30)
    assert not errors, errors
