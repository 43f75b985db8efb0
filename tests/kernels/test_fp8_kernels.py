"""FP8 kernels against their PyTorch references: the GEMV with an fp8 weight and per-row scales
(and its fused SiLU-and-mul form), and per-token activation quantization.

The GEMV widens each e4m3 weight exactly to fp32, so its reference is `fp8_linear_reference` without
input quantization, computed in float64 here: the kernel differs only by fp32 summation order and
the output's rounding. The quantization kernel must give the reference's scales to fp32 rounding
and the same e4m3 values, except where x / s lands within an fp32 ulp of a rounding boundary.
"""

from __future__ import annotations

import platform
import sys

import pytest
import torch
import torch.nn.functional as F

if not (sys.platform == "linux" and platform.machine() == "x86_64"):
    pytest.importorskip("triton")

from pagoda.kernels.fp8_quant import per_token_quant
from pagoda.kernels.gemv import gemv, gemv_silu_and_mul, supports
from pagoda.layers.activation import silu_and_mul_reference
from pagoda.layers.quantization.fp8 import FP8, quantize_per_channel, quantize_per_token_reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SHAPES = [(1, 24, 40), (2, 16, 33), (3, 10, 96)]  # (M, N, K): odd N and K on purpose
if DEVICE == "cuda":
    SHAPES += [(1, 6144, 2048), (4, 2048, 8192), (1, 1000, 3000)]


def _weights(n, k, seed):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * torch.rand(n, 1, generator=g) * 3  # rows of different ranges
    wq, scale = quantize_per_channel(w)
    return wq.to(DEVICE), scale.to(DEVICE), g


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("m,n,k", SHAPES)
def test_fp8_gemv_matches_the_dequantized_linear(m, n, k, dtype):
    wq, scale, g = _weights(n, k, m * 100 + n + k)
    x = torch.randn(m, k, generator=g).to(DEVICE, dtype)
    bias = torch.randn(n, generator=g).to(DEVICE, dtype)
    assert supports(x, wq, max_rows=8, weight_scale=scale) and not supports(x, wq, max_rows=8)
    y = gemv(x, wq, bias, weight_scale=scale)
    exact = F.linear(x.double(), wq.double() * scale.double()[:, None], bias.double())
    assert y.dtype == dtype and y.shape == (m, n)
    tol = torch.finfo(dtype).eps * exact.abs() + 1e-5 * (
        x.double().abs() @ (wq.double() * scale.double()[:, None]).abs().t()
    )
    assert bool(((y.double() - exact).abs() <= tol).all())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fp8_gemv_silu_and_mul_matches_two_steps(dtype):
    n2, k = 48, 40
    wq, scale, g = _weights(n2, k, 7)
    x = torch.randn(1, k, generator=g).to(DEVICE, dtype)
    fused = gemv_silu_and_mul(x, wq, weight_scale=scale)
    two_steps = silu_and_mul_reference(gemv(x, wq, weight_scale=scale))
    torch.testing.assert_close(fused, two_steps, atol=0, rtol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("m,k", [(1, 40), (5, 33), (3, 130)])  # 130 > the interpreter's 64-wide tile: two passes
def test_per_token_quant_matches_reference(m, k, dtype):
    g = torch.Generator().manual_seed(m + k)
    x = (torch.randn(m, k, generator=g) * torch.logspace(-3, 2, m)[:, None]).to(DEVICE, dtype)
    x[0, 0] = 0.0
    q, s = per_token_quant(x)
    q_ref, s_ref = quantize_per_token_reference(x)
    assert q.dtype == FP8 and s.shape == (m, 1)
    torch.testing.assert_close(s, s_ref, rtol=1e-6, atol=0)
    got, ref = q.float(), q_ref.float()
    if DEVICE == "cpu":
        # Triton 3.6's interpreter drops the carry when rounding up to the next power of two
        # (31.5 → 16 instead of 32); the GPU converts in hardware. Those elements only are excused.
        carry = (ref.abs() == torch.exp2(torch.log2(ref.abs()).round())) & (got == ref / 2)
        got = torch.where(carry, ref, got)
    # same e4m3 values, up to one e4m3 step where x/s sits on a rounding boundary
    diff = (got - ref).abs()
    step = ref.abs().clamp_min(2**-6) * 2**-3
    assert bool((diff <= step).all()) and (diff == 0).float().mean() > 0.99
    if DEVICE == "cuda":  # the dequantized row is x to within e4m3's half step
        assert bool(((got * s - x.float()).abs() <= s * 448 * 2**-4 + 1e-30).all())


def test_per_token_quant_all_zero_row():
    x = torch.zeros(2, 16, device=DEVICE)
    q, s = per_token_quant(x)
    assert bool((q.float() == 0).all()) and bool((s > 0).all())


@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_scale_epilogue_matches_reference(with_bias, dtype):
    from pagoda.kernels.fp8_quant import scale_epilogue

    g = torch.Generator().manual_seed(7)
    m, n = 5, 150  # 150 > the interpreter's 64-wide tile: three column blocks, the last ragged
    y = (torch.randn(m, n, generator=g) * 300).to(DEVICE, dtype)
    sx, sw = torch.rand(m, 1, generator=g).to(DEVICE), torch.rand(n, generator=g).to(DEVICE)
    bias = torch.randn(n, generator=g).to(DEVICE, dtype) if with_bias else None
    product = y.double() * sx.double() * sw.double()
    ref = product + (0 if bias is None else bias.double())
    scale_epilogue(y, sx, sw, bias)
    # fp32 arithmetic, one rounding to the output dtype: within an ulp of the larger term
    ulp = 2**-7 if dtype == torch.bfloat16 else 2**-22
    bound = ulp * (product.abs() + (0 if bias is None else bias.double().abs())) + 1e-30
    assert bool(((y.double() - ref).abs() <= bound).all())
