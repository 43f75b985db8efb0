"""The vision tower's segment attention: which calls may build a cuDNN plan, and that every backend it picks gives
softmax attention (a naive reference on the CPU; cuDNN against FlashAttention on a Hopper GPU)."""

import torch
import torch.nn.functional as F

from pagoda.layers.segment_attention import ShapeGate, segment_attention


def test_a_shape_takes_cudnn_from_its_nth_pass_on_however_many_calls_a_pass_makes():
    gate = ShapeGate(after=3)
    a, b = ("n2", "L3888"), ("n3", "L3888")
    seen = []
    for _ in range(4):
        gate.begin_pass()
        seen.append([gate.use_cudnn(a) for _ in range(32)])  # one call per layer
    assert [set(p) for p in seen] == [{False}, {False}, {True}, {True}]
    gate.begin_pass()
    assert [gate.use_cudnn(b) for _ in range(3)] == [False] * 3  # counted per shape: b's first pass
    for _ in range(2):
        gate.begin_pass()
        gate.use_cudnn(b)
    assert gate.use_cudnn(b) and gate.use_cudnn(a)


def test_after_one_is_cudnn_always_and_zero_never():
    for after, expected in ((1, True), (0, False)):
        gate = ShapeGate(after=after)
        for _ in range(3):
            gate.begin_pass()
            assert gate.use_cudnn(("s",)) is expected


def _sdpa(q, k, v):
    return F.scaled_dot_product_attention(q, k, v)


def _naive(q, k, v):
    w = torch.softmax((q.double() @ k.double().transpose(-1, -2)) / q.shape[-1] ** 0.5, dim=-1)
    return (w @ v.double()).to(q.dtype)


def test_matches_softmax_attention_on_the_cpu():
    torch.manual_seed(0)
    q, k, v = (torch.randn(3, 4, 37, 16) for _ in range(3))  # 3 segments of 37 rows, 4 heads
    torch.testing.assert_close(segment_attention(q, k, v), _naive(q, k, v), atol=1e-5, rtol=1e-5)


def test_the_first_passes_of_a_shape_ask_for_flash_and_later_ones_for_cudnn(monkeypatch):
    """Where cuDNN applies (forced here on the CPU, where SDPA then falls through to its math kernel), each call
    hands SDPA the backend list its shape's pass count picks, and every call still gives softmax attention."""
    from pagoda.layers import segment_attention as sa

    asked = []
    monkeypatch.setattr(sa, "_gated", lambda q: True)
    monkeypatch.setattr(sa, "_attend", lambda q, k, v, cudnn: asked.append(cudnn) or _sdpa(q, k, v))
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 19, 16) for _ in range(3))
    other = q[:1]  # another shape: counted on its own
    gate = ShapeGate(after=2)
    outs = []
    for inputs in [(q, k, v), (other, k[:1], v[:1]), (q, k, v)]:
        gate.begin_pass()
        outs += [segment_attention(*inputs, gate) for _ in range(2)]  # two layers
    assert asked == [False, False, False, False, True, True]  # flash, flash, then cuDNN from the 2nd pass
    for out, (a, b, c) in zip(outs, [(q, k, v)] * 2 + [(other, k[:1], v[:1])] * 2 + [(q, k, v)] * 2):
        torch.testing.assert_close(out, _naive(a, b, c), atol=1e-5, rtol=1e-5)


def test_the_tower_counts_one_pass_per_forward(monkeypatch):
    """The vision tower's layers share one pass per forward: with the default gate (cuDNN from a shape's 3rd
    pass), the first two forwards of an image size send every layer's attention to flash, the third to cuDNN."""
    from pagoda.layers import segment_attention as sa
    from pagoda.models.qwen2_vl_vision import Qwen2VisionTransformer, vision_config_with_defaults

    asked = []
    monkeypatch.setattr(sa, "_GATE", ShapeGate(after=3))
    monkeypatch.setattr(sa, "_gated", lambda q: True)
    monkeypatch.setattr(sa, "_attend", lambda q, k, v, cudnn: asked.append(cudnn) or _sdpa(q, k, v))
    cfg = vision_config_with_defaults({"depth": 4, "embed_dim": 32, "num_heads": 2}, text_hidden=16)
    tower = Qwen2VisionTransformer(cfg).eval()
    pixels = torch.randn(16, 3 * 2 * 14 * 14)
    with torch.no_grad():
        for expected in (False, False, True):  # flash, flash, cuDNN
            asked.clear()
            tower(pixels, [(1, 4, 4)])
            assert asked == [expected] * 4


def test_a_refused_direct_kernel_call_falls_back_to_sdpa_for_good(monkeypatch, caplog):
    """A PyTorch whose cuDNN or flash op no longer takes these arguments: the call still gives attention (SDPA's
    own choice), once warned, and no later call tries the op again."""
    from pagoda.layers import segment_attention as sa

    calls = []

    def refused(*args):
        calls.append(1)
        raise RuntimeError("no kernel for this")

    monkeypatch.setattr(sa, "_DIRECT_REFUSED", False)
    monkeypatch.setattr(torch.ops.aten, "_scaled_dot_product_flash_attention", refused, raising=False)
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 19, 16, dtype=torch.bfloat16) for _ in range(3))
    for _ in range(2):
        torch.testing.assert_close(sa._attend(q, k, v, cudnn=False), _sdpa(q, k, v))
    assert calls == [1] and sa._DIRECT_REFUSED and caplog.text.count("direct kernel call failed") == 1
