"""Requests from the API processes to the core over ZMQ (`core_process.to_frames` / `from_frames`): an image's
arrays travel as frames of their own and come back equal, writable and backed by the received frames; other
messages stay one frame, and one sent by `send_pyobj` (the launcher's Shutdown) is read the same way."""

from __future__ import annotations

import numpy as np
import pytest
import zmq

from pagoda.engine.core_process import AbortRequests, AddRequest, Shutdown, from_frames, to_frames
from pagoda.inputs import MultiModalInputs, MultiModalItem
from pagoda.sampling_params import SamplingParams


def _image_request(rng: np.random.Generator) -> AddRequest:
    pixels = rng.integers(0, 256, (3888, 588), dtype=np.uint8)  # a 1000x750 image's levels, one frame a patch
    lut = rng.random((3, 256)).astype(np.float32)
    item = MultiModalItem("image", pixels, (1, 54, 72), 5, 972, b"h" * 16, lut, 2)
    mm = MultiModalInputs([item], rng.integers(0, 900, (3, 1000)).astype(np.int64), -3, {"image": 972})
    return AddRequest("r", list(range(1000)), SamplingParams(max_tokens=8), "p", True, 1.5, mm)


@pytest.fixture
def pair():
    context = zmq.Context()
    pull, push = context.socket(zmq.PULL), context.socket(zmq.PUSH)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    push.connect(f"tcp://127.0.0.1:{port}")
    yield push, pull
    push.close(linger=0)
    pull.close(linger=0)
    context.term()


def test_an_image_request_crosses_with_its_arrays_out_of_band(pair):
    push, pull = pair
    sent = _image_request(np.random.default_rng(0))
    frames = to_frames(sent)
    item = sent.mm_inputs.items[0]
    assert len(frames) >= 2 and len(frames[0]) < 64 * 1024  # the pixels are not in the pickle
    assert any(memoryview(f).nbytes == item.pixel_values.nbytes for f in frames[1:])
    push.send_serialized(sent, to_frames, copy=False)
    got = pull.recv_serialized(from_frames, copy=False)
    assert isinstance(got, AddRequest) and got.prompt_token_ids == sent.prompt_token_ids
    assert (got.request_id, got.prompt, got.arrival_time, got.params.max_tokens) == ("r", "p", 1.5, 8)
    mine, theirs = got.mm_inputs.items[0], item
    for name in ("pixel_values", "pixel_lut"):
        a, b = getattr(mine, name), getattr(theirs, name)
        assert a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b) and a.flags.writeable
    assert (mine.grid_thw, mine.offset, mine.length, mine.content_hash, mine.temporal_repeat) == (
        theirs.grid_thw,
        theirs.offset,
        theirs.length,
        theirs.content_hash,
        theirs.temporal_repeat,
    )
    assert np.array_equal(got.mm_inputs.mrope_positions, sent.mm_inputs.mrope_positions)
    assert got.mm_inputs.mrope_delta == -3 and got.mm_inputs.counts == {"image": 972}


def test_other_messages_are_one_frame_and_send_pyobj_is_read_alike(pair):
    push, pull = pair
    assert len(to_frames(AbortRequests(["a", "b"], 2))) == 1
    push.send_serialized(AbortRequests(["a", "b"], 2), to_frames, copy=False)
    push.send_pyobj(Shutdown())
    got = pull.recv_serialized(from_frames, copy=False)
    assert isinstance(got, AbortRequests) and got.request_ids == ["a", "b"] and got.client_index == 2
    assert isinstance(pull.recv_serialized(from_frames, copy=False), Shutdown)
