"""The few-row GEMV kernel against `F.linear` / `torch.addmm` computed in float64.

The kernel sums products in fp32 in its own order, then rounds once: it may differ from the exact
result by an ulp of the output plus the fp32 sum's own rounding (which shows where terms cancel). On CPU
the kernel runs under the Triton interpreter (`conftest.py`): tiny shapes, with K not a multiple of the
K tile to cover the masked path.
"""

from __future__ import annotations

import platform
import sys

import pytest
import torch
import torch.nn.functional as F

if not (sys.platform == "linux" and platform.machine() == "x86_64"):
    pytest.importorskip("triton")

from pagoda.kernels import gemv as gemv_module
from pagoda.kernels import policy
from pagoda.kernels.gemv import GemvConfig, gemv, supports

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def assert_near_exact(y, x, w, bias=None, base=None):
    """y within one ulp of the exact (float64) result, plus what an fp32 sum of K products may lose
    to rounding (2·K·2^-24 of Σ|x·w|: visible where the terms cancel and the result is small)."""
    exact = x.double() @ w.double().t()
    for extra in (bias, base):
        if extra is not None:
            exact = exact + extra.double()
    info = torch.finfo(y.dtype)
    magnitude = exact.to(y.dtype).double().abs().clamp_min(info.smallest_normal)
    one_ulp = info.eps * torch.exp2(torch.floor(torch.log2(magnitude)))  # the output dtype's ulp there
    slack = 2 * x.shape[-1] * 2.0**-24 * (x.double().abs() @ w.double().abs().t())
    err = (y.double() - exact).abs()
    assert bool((err <= one_ulp + slack).all()), float((err - one_ulp - slack).max())


SHAPES = [(1, 24, 40), (1, 7, 64), (2, 16, 33), (3, 10, 96)]  # (M, N, K): odd N and K on purpose
if DEVICE == "cuda":
    SHAPES += [(1, 2048, 2048), (1, 1024, 4096), (1, 2048, 8192), (1, 16384, 2048), (4, 4096, 2048), (1, 1000, 3000)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("m,n,k", SHAPES)
@pytest.mark.parametrize("with_bias", [False, True])
def test_matches_linear(m, n, k, dtype, with_bias):
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    x = torch.randn(m, k, generator=g).to(DEVICE, dtype)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(DEVICE, dtype)
    bias = torch.randn(n, generator=g).to(DEVICE, dtype) if with_bias else None
    y = gemv(x, w, bias)
    assert y.shape == (m, n) and y.dtype == dtype
    assert_near_exact(y, x, w, bias)
    # and agrees with what the layer would otherwise run
    assert torch.allclose(
        y.float(), F.linear(x.float(), w.float(), None if bias is None else bias.float()), atol=2e-2, rtol=2e-2
    )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_accumulates_into_a_strided_view_like_addmm(dtype):
    """LF conv1's use: out is the right half of a [M, 2N] buffer holding the bias; y = out + x·Wᵀ."""
    m, n, k = 1, 12, 40
    g = torch.Generator().manual_seed(3)
    buffer = torch.randn(m, 2 * n, generator=g).to(DEVICE, dtype)
    left_before = buffer[:, :n].clone()
    base = buffer[:, n:].clone()
    x = torch.randn(m, k, generator=g).to(DEVICE, dtype)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(DEVICE, dtype)
    out = buffer[:, n:]
    gemv(x, w, out=out, accumulate=True)
    assert_near_exact(buffer[:, n:], x, w, base=base)
    assert torch.equal(buffer[:, :n], left_before)  # nothing written outside the view


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n,k", [(12, 40), (7, 64)] + ([(1024, 2048), (2048, 1024)] if DEVICE == "cuda" else []))
def test_float32_partial_sum_then_its_second_half_rounds_once(n, k, dtype):
    """The LF gate's split convolution: t = A0·x_prev + bias kept in float32 (nothing rounded), then
    y = A1·x + t rounded once; together the one-GEMV result over [x_prev | x], within fp32 order. Both
    weight halves are column views of one [N, 2K] matrix (row stride 2K)."""
    g = torch.Generator().manual_seed(n + k)
    w = (torch.randn(n, 2 * k, generator=g) / k**0.5).to(DEVICE, dtype)
    x_prev, x = (torch.randn(1, k, generator=g).to(DEVICE, dtype) for _ in range(2))
    bias = torch.randn(n, generator=g).to(DEVICE, dtype)
    partial = torch.empty(1, n, dtype=torch.float32, device=DEVICE)
    gemv(x_prev, w[:, :k], bias, out=partial)
    assert_near_exact(partial, x_prev.float(), w[:, :k].float(), bias.float())  # fp32 ulps: not rounded
    y = gemv(x, w[:, k:], partial.view(-1))
    assert y.dtype == dtype
    assert_near_exact(y, torch.cat([x_prev, x], dim=-1), w, bias)
    with pytest.raises(ValueError, match="out must be"):
        gemv(x, w[:, k:], out=torch.empty(1, n, dtype=torch.float64, device=DEVICE))


def test_leading_dims_and_strided_input():
    x = torch.randn(1, 1, 64).to(DEVICE, torch.bfloat16)
    w = torch.randn(8, 64).to(DEVICE, torch.bfloat16)
    assert gemv(x, w).shape == (1, 1, 8)
    wide = torch.randn(1, 128).to(DEVICE, torch.bfloat16)
    view = wide[:, 64:]  # row stride 128, unit column stride
    assert_near_exact(gemv(view, w), view, w)


def test_explicit_config_with_several_k_tiles():
    x = torch.randn(1, 100).to(DEVICE, torch.bfloat16)
    w = torch.randn(6, 100).to(DEVICE, torch.bfloat16)
    y = gemv(x, w, config=GemvConfig(block_n=1, block_k=16, num_warps=1))
    assert_near_exact(y, x, w)


ONE_TILE_SHAPES = [(5, 12, 40), (16, 7, 64), (3, 9, 17)]
if DEVICE == "cuda":  # SmolLM2-135M's q/k/v, its head (four columns a program), a Qwen2-VL-2B-sized gate/up at 2 rows
    ONE_TILE_SHAPES += [(4, 960, 576), (4, 49152, 576), (2, 17920, 1536)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("m,n,k", ONE_TILE_SHAPES)
@pytest.mark.parametrize("with_bias", [False, True])
def test_rows_of_one_tile_equal_their_one_row_calls(m, n, k, dtype, with_bias):
    """K within one tile: the rows are reduced in turn against one weight tile, each exactly as a call
    with that row alone reduces it. So every row equals its one-row result bit for bit (what keeps a
    speculative verification's rows equal to plain decode steps), and all are near the exact product."""
    g = torch.Generator().manual_seed(m * 31 + n + k)
    x = torch.randn(m, k, generator=g).to(DEVICE, dtype)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(DEVICE, dtype)
    bias = torch.randn(n, generator=g).to(DEVICE, dtype) if with_bias else None
    rule = gemv_module.gemv_config(m, n, k)
    config = rule if DEVICE == "cuda" else GemvConfig(block_n=2, block_k=triton_next_power_of_2(k), num_warps=2)
    assert config.block_k >= k  # one tile: the row loop
    y = gemv(x, w, bias, config=config)
    assert_near_exact(y, x, w, bias)
    for row in range(m):
        assert torch.equal(y[row], gemv(x[row : row + 1], w, bias, config=config)[0]), row
    # the tiled path (K in several tiles) reaches the same values within fp32 order
    tiled = gemv(x, w, bias, config=GemvConfig(block_n=2, block_k=16, num_warps=2))
    assert_near_exact(tiled, x, w, bias)


def triton_next_power_of_2(k: int) -> int:
    return 1 << (k - 1).bit_length()


def test_row_bound_follows_the_weight_size(monkeypatch):
    """The row loop's bound by weight size (`policy.GEMV_LOOP_ROWS`); K past one tile keeps one row."""
    monkeypatch.setattr(policy, "GEMV_LOOP_ROWS", ((64, 4), (512, 2)))
    monkeypatch.setattr(gemv_module, "LOOP_ROWS", None)
    x = torch.randn(8, 32).to(DEVICE, torch.bfloat16)
    for n, rows in ((2, 4), (16, 2), (17, policy.GEMV_MAX_ROWS)):  # 64, 512 and 544 elements
        w = torch.randn(n, 32).to(DEVICE, torch.bfloat16)
        assert gemv_module.max_rows_for(w) == rows
        assert supports(x[:rows], w) and not supports(x[: rows + 1], w)
    monkeypatch.setattr(gemv_module, "MAX_BLOCK_K", 16)  # K = 32 now needs two tiles
    assert gemv_module.max_rows_for(torch.randn(2, 32)) == policy.GEMV_MAX_ROWS
    monkeypatch.setattr(gemv_module, "MAX_BLOCK_K", 4096)
    monkeypatch.setattr(gemv_module, "LOOP_ROWS", 1)  # PAGODA_GEMV_LOOP_ROWS=1: one-row matmuls only
    assert gemv_module.max_rows_for(torch.randn(2, 32)) == policy.GEMV_MAX_ROWS


def test_supports_rejects_what_it_cannot_run():
    w = torch.randn(8, 64).to(DEVICE, torch.bfloat16)
    assert supports(torch.randn(1, 64).to(DEVICE, torch.bfloat16), w)
    rows = gemv_module.max_rows_for(w)
    assert supports(torch.randn(rows, 64).to(DEVICE, torch.bfloat16), w)
    assert not supports(torch.randn(rows + 1, 64).to(DEVICE, torch.bfloat16), w)
    assert not supports(torch.randn(1, 64).to(DEVICE, torch.float32), w)  # mixed dtypes
    assert not supports(torch.randn(1, 32).to(DEVICE, torch.bfloat16), w)
    assert not supports(torch.randn(1, 8).to(DEVICE, torch.bfloat16), w.t())  # K not contiguous
    assert not supports(torch.randn(0, 64).to(DEVICE, torch.bfloat16), w)


def test_rejects_bad_out_and_bias():
    x = torch.randn(1, 64).to(DEVICE, torch.bfloat16)
    w = torch.randn(8, 64).to(DEVICE, torch.bfloat16)
    with pytest.raises(ValueError, match="accumulate"):
        gemv(x, w, accumulate=True)
    with pytest.raises(ValueError, match="out must be"):
        gemv(x, w, out=torch.empty(1, 9).to(DEVICE, torch.bfloat16))
    with pytest.raises(ValueError, match="bias"):
        gemv(x, w, bias=torch.empty(9).to(DEVICE, torch.bfloat16))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("n,k", [(12, 40), (7, 64), (16, 33)])
def test_silu_and_mul_fused_into_the_gemv_rounds_like_the_two_kernels(n, k, dtype):
    """One row through `gemv_silu_and_mul` equals `silu_and_mul(gemv(x, W))` bit for bit (same
    rounding points), and both agree with the PyTorch layers' path up to the matmul's rounding."""
    from pagoda.kernels import activation as activation_kernels
    from pagoda.kernels.gemv import gemv_silu_and_mul
    from pagoda.layers.activation import silu_and_mul_reference

    g = torch.Generator().manual_seed(n * 100 + k)
    x = torch.randn(1, k, generator=g).to(DEVICE, dtype)
    w = (torch.randn(2 * n, k, generator=g) * 2 / k**0.5).to(DEVICE, dtype)
    fused = gemv_silu_and_mul(x, w)
    assert fused.shape == (1, n) and fused.dtype == dtype
    assert torch.equal(fused, activation_kernels.silu_and_mul(gemv(x, w)))
    torch.testing.assert_close(
        fused.float(), silu_and_mul_reference(F.linear(x.float(), w.float())), atol=3e-2, rtol=3e-2
    )
    assert gemv_silu_and_mul(x.view(1, 1, k), w).shape == (1, 1, n)


def test_silu_and_mul_gemv_rejects_what_it_cannot_run():
    from pagoda.kernels.gemv import gemv_silu_and_mul

    x = torch.randn(2, 64).to(DEVICE, torch.bfloat16)
    with pytest.raises(ValueError, match="one row"):
        gemv_silu_and_mul(x, torch.randn(8, 64).to(DEVICE, torch.bfloat16))
    with pytest.raises(ValueError, match="2I"):
        gemv_silu_and_mul(x[:1], torch.randn(7, 64).to(DEVICE, torch.bfloat16))


def test_dispatch_switch_and_device(monkeypatch):
    """PAGODA_GEMV=0 turns the kernel off; CPU tensors never get it (the layers keep F.linear)."""
    from pagoda.kernels import dispatch

    dispatch.gemv_module.cache_clear()
    try:
        assert dispatch.gemv_module() is gemv_module
        assert dispatch.gemv_for(torch.zeros(2)) is None
        dispatch.gemv_module.cache_clear()
        monkeypatch.setenv("PAGODA_GEMV", "0")
        assert dispatch.gemv_module() is None
    finally:
        dispatch.gemv_module.cache_clear()
