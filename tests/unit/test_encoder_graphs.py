"""Which of the vision encoder's forwards are captured in CUDA graphs (`pagoda/worker/encoder_graphs.py`); the
replays themselves are tested against eager forwards on a GPU (tests/kernels/test_encoder_graph_replays.py)."""

from __future__ import annotations

from pagoda.worker.encoder_graphs import CapturePolicy

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
