"""The vision encoder's CUDA graphs (`pagoda/worker/encoder_graphs.py`) replayed against eager forwards of the
tiny Qwen2-VL's tower (a GPU only: graphs cannot be captured elsewhere)."""

from __future__ import annotations

import pytest
import torch

from pagoda.worker.encoder_graphs import CapturePolicy, EncoderGraphs
from tests.models import test_qwen2vl_parity as parity

tiny_qwen2vl = parity.tiny_qwen2vl  # the fixture: a tiny Qwen2-VL folder


def _pixels(grids, width, seed):
    g = torch.Generator().manual_seed(seed)
    rows = sum(t * h * w for t, h, w in grids)
    return torch.randn(rows, width, generator=g).cuda()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("background", [False, True], ids=["inline", "capture-thread"])
def test_replays_equal_eager_forwards_for_one_image_mixed_sizes_and_a_video(tiny_qwen2vl, monkeypatch, background):
    """The tiny Qwen2-VL's tower in bfloat16 on the GPU: each key's replay equals the eager `encode` bit for bit,
    with fresh pixels on every call (a stale input buffer or a host copy repeated by the graph would differ),
    and mixed sizes in an order the tower regroups (its row orders are device tensors the graph keeps). The
    attention takes one backend throughout (its gate would otherwise move a shape from flash to cuDNN between the
    eager reference and the capture). On the capture thread, the forward that hands a key over runs eagerly, and
    the key's graph serves once the capture is done."""
    from pagoda.layers import segment_attention

    monkeypatch.setattr(segment_attention._GATE, "after", 1)
    model = parity.Engine(tiny_qwen2vl, attention_backend="triton").engine.runner.model.to(torch.bfloat16)
    width = model.visual.patch_embed.proj.weight.shape[1]
    graphs = EncoderGraphs(model, torch.device("cuda"), CapturePolicy(max_patches=10**6, after=1), background)
    eager_calls = []
    encode = model.encode
    cases = [
        [(1, 4, 4)],
        [(1, 4, 4), (1, 6, 4), (1, 4, 4)],  # regrouped by length inside the tower, restored after
        [(2, 4, 6), (1, 4, 4)],  # a video of two temporal patches, then an image
    ]
    with torch.inference_mode():
        for i, grids in enumerate(cases):
            if background:  # the first sighting hands the key over and runs eagerly
                monkeypatch.setattr(model, "encode", lambda *a: eager_calls.append(1) or encode(*a))
                first = graphs.encode(_pixels(grids, width, 99), grids)
                assert len(eager_calls) == 1 and first.shape[0] == sum(t * h * w for t, h, w in grids) // 4
                eager_calls.clear()
                graphs.wait()
                monkeypatch.setattr(model, "encode", encode)
            for seed in (i, i + 10):
                pixels = _pixels(grids, width, seed)
                eager = model.encode(pixels, grids)
                replayed = graphs.encode(pixels, grids)
                torch.testing.assert_close(replayed, eager, rtol=0, atol=0)
            assert len(graphs) == i + 1  # each key's replays came from its graph
