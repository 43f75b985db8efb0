"""The vision tower's segment attention on a Hopper GPU, where cuDNN's SDPA exists: its flash and cuDNN calls agree
with each other and with softmax attention, and the kernels called directly give SDPA's own bits. The gate and the
CPU path are tested in tests/unit/test_segment_attention.py."""

import pytest
import torch
import torch.nn.functional as F

from pagoda.layers.segment_attention import ShapeGate, segment_attention
from tests.unit.test_segment_attention import _naive

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9, reason="cuDNN SDPA is picked on sm90+"
)


def test_flash_calls_and_cudnn_calls_agree_on_a_hopper_gpu():
    torch.manual_seed(0)
    qkv = torch.randn(2 * 1024, 3, 16, 80, device="cuda", dtype=torch.bfloat16)  # the tower's fused projection

    def to_batch(t):
        return t.reshape(2, 1024, 16, 80).transpose(1, 2)

    q, k, v = (to_batch(t) for t in qkv.unbind(dim=1))
    gate = ShapeGate(after=2)
    first, second = [], []
    for out in (first, second):  # flash, then cuDNN
        gate.begin_pass()
        out.append(segment_attention(q, k, v, gate))
    first, second = first[0], second[0]
    torch.testing.assert_close(first, second, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(first.float(), _naive(q.float(), k.float(), v.float()), atol=2e-2, rtol=2e-2)


def test_the_kernels_called_directly_give_sdpas_own_bits_for_each_backend():
    """`_attend` calls cuDNN's and flash's ops without SDPA's process-wide backend switches: bit for bit what SDPA
    gives with that backend alone."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from pagoda.layers.segment_attention import _attend

    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 16, 700, 80, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    for cudnn, backend in ((True, SDPBackend.CUDNN_ATTENTION), (False, SDPBackend.FLASH_ATTENTION)):
        with sdpa_kernel([backend]):
            expected = F.scaled_dot_product_attention(q, k, v)
        torch.testing.assert_close(_attend(q, k, v, cudnn), expected, rtol=0, atol=0)
