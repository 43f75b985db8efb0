"""The vision tower's segment attention: which calls may build a cuDNN plan, and that every backend it picks gives
softmax attention (a naive reference on the CPU; cuDNN against FlashAttention on a Hopper GPU)."""

import pytest
import torch

from pagoda.layers.segment_attention import ShapeGate, segment_attention


def test_a_shape_takes_cudnn_from_its_nth_call_on():
    gate = ShapeGate(after=3)
    a, b = ("n2", "L3888"), ("n3", "L3888")
    assert [gate.use_cudnn(a) for _ in range(5)] == [False, False, True, True, True]
    assert [gate.use_cudnn(b) for _ in range(3)] == [False, False, True]  # counted per shape


def test_after_one_is_cudnn_always_and_zero_never():
    assert all(ShapeGate(after=1).use_cudnn(("s",)) for _ in range(3))
    assert not any(ShapeGate(after=0).use_cudnn(("s",)) for _ in range(3))


def _naive(q, k, v):
    w = torch.softmax((q.double() @ k.double().transpose(-1, -2)) / q.shape[-1] ** 0.5, dim=-1)
    return (w @ v.double()).to(q.dtype)


def test_matches_softmax_attention_on_the_cpu():
    torch.manual_seed(0)
    q, k, v = (torch.randn(3, 4, 37, 16) for _ in range(3))  # 3 segments of 37 rows, 4 heads
    torch.testing.assert_close(segment_attention(q, k, v), _naive(q, k, v), atol=1e-5, rtol=1e-5)


def test_the_first_calls_of_a_shape_ask_for_flash_and_later_ones_for_cudnn(monkeypatch):
    """Where cuDNN applies (forced here on the CPU, where SDPA then falls through to its math kernel), each call
    hands SDPA the backend list its shape's count picks, and every call still gives softmax attention."""
    from pagoda.layers import segment_attention as sa

    asked = []
    real = sa.sdpa_kernel
    monkeypatch.setattr(sa, "_gated", lambda q: True)
    monkeypatch.setattr(sa, "sdpa_kernel", lambda backends, **kw: asked.append(backends) or real(backends, **kw))
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 19, 16) for _ in range(3))
    other = q[:1]  # another shape: counted on its own
    gate = ShapeGate(after=2)
    outs = [segment_attention(q, k, v, gate), segment_attention(other, k[:1], v[:1], gate)]
    outs += [segment_attention(q, k, v, gate), segment_attention(q, k, v, gate)]
    assert [b[0] for b in asked] == [
        torch.nn.attention.SDPBackend.FLASH_ATTENTION,
        torch.nn.attention.SDPBackend.FLASH_ATTENTION,
        torch.nn.attention.SDPBackend.CUDNN_ATTENTION,
        torch.nn.attention.SDPBackend.CUDNN_ATTENTION,
    ]
    for out, (a, b, c) in zip(outs, [(q, k, v), (other, k[:1], v[:1]), (q, k, v), (q, k, v)]):
        torch.testing.assert_close(out, _naive(a, b, c), atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9, reason="cuDNN SDPA is picked on sm90+"
)
def test_flash_calls_and_cudnn_calls_agree_on_a_hopper_gpu():
    torch.manual_seed(0)
    qkv = torch.randn(2 * 1024, 3, 16, 80, device="cuda", dtype=torch.bfloat16)  # the tower's fused projection

    def to_batch(t):
        return t.reshape(2, 1024, 16, 80).transpose(1, 2)

    q, k, v = (to_batch(t) for t in qkv.unbind(dim=1))
    gate = ShapeGate(after=2)
    first, second = segment_attention(q, k, v, gate), segment_attention(q, k, v, gate)  # flash, then cuDNN
    torch.testing.assert_close(first, second, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(first.float(), _naive(q.float(), k.float(), v.float()), atol=2e-2, rtol=2e-2)
