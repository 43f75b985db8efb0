"""The int4 (AWQ/GPTQ) matmul kernels against `int4_matmul_reference` computed in float64.

In float64 the reference is the exact result of the quantized weights. The kernels sum exact products
in fp32 and round once, so they are within an ulp of the output plus the fp32 sum's own rounding; the
act-order GEMM also rounds each dequantized weight to x's dtype first (for the tensor cores), which
the bound allows for there. On CPU the kernels run under the Triton interpreter (`conftest.py`): tiny
shapes, with N not a multiple of the column tile and K not of the K tile, to cover the masked paths.
"""

from __future__ import annotations

import platform
import sys

import pytest
import torch

if not (sys.platform == "linux" and platform.machine() == "x86_64"):
    pytest.importorskip("triton")

from pagoda.kernels import policy
from pagoda.kernels.int4_gemm import Int4Config, int4_matmul, supports
from pagoda.layers.quantization.int4_formats import (
    awq_to_internal,
    dequantize,
    gptq_to_internal,
    int4_matmul_reference,
    quantize_awq,
    quantize_gptq,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def gptq_weights(n: int, k: int, group: int, act_order: bool, dtype: torch.dtype, seed: int = 0):
    """Pagoda's layout of a random [n, k] weight quantized as an asymmetric GPTQ checkpoint, scales and
    zero points in dtype (as the layer keeps them)."""
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) / k**0.5
    qweight, qzeros, scales, g_idx = quantize_gptq(w, group, sym=False, act_order=act_order, seed=seed)
    internal = gptq_to_internal(
        qweight,
        qzeros,
        scales,
        g_idx if act_order else None,
        bits=4,
        sym=False,
        checkpoint_format="gptq",
        group_size=group,
    )
    q, s, z, g = internal
    return q.to(DEVICE), s.to(DEVICE, dtype), z.to(DEVICE, dtype), g.to(DEVICE)


def assert_near_exact(y, x, weights, bias=None, weights_rounded=False):
    """y within one ulp of the exact result plus what an fp32 sum of K products may lose (2·K·2^-24 of
    Σ|x·w|); weights_rounded: plus each weight's rounding to y's dtype (half an ulp of it, relative)."""
    qweight, scales, zeros, g_idx = weights
    w = dequantize(qweight, scales, zeros, g_idx).double()
    exact = int4_matmul_reference(
        x.double(), qweight, scales.double(), zeros.double(), g_idx, None if bias is None else bias.double()
    )
    info = torch.finfo(y.dtype)
    magnitude = exact.to(y.dtype).double().abs().clamp_min(info.smallest_normal)
    one_ulp = info.eps * torch.exp2(torch.floor(torch.log2(magnitude)))
    relative = 2 * x.shape[1] * 2.0**-24 + (info.eps / 2 if weights_rounded else 0.0)
    slack = relative * (x.double().abs() @ w.abs().t())
    err = (y.double() - exact).abs()
    assert bool((err <= one_ulp + slack).all()), float((err - one_ulp - slack).max())


# (layout, K, group): rows in order in groups of 64 (the kernel computes the group), the same rows
# read through g_idx after an act-order permutation, and one group over all of K with a masked K tail.
LAYOUTS = [("groups", 192, 64), ("act_order", 192, 32), ("one_group", 200, -1)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 3, 17])  # the GEMV for up to policy.INT4_GEMV_MAX_ROWS rows, the GEMM above
@pytest.mark.parametrize("layout,k,group", LAYOUTS)
@pytest.mark.parametrize("with_bias", [False, True])
def test_matches_exact_result(layout, k, group, m, dtype, with_bias):
    n = 40
    act_order = layout == "act_order"
    weights = gptq_weights(n, k, group, act_order, dtype, seed=k + m)
    g = torch.Generator().manual_seed(m)
    x = torch.randn(m, k, generator=g).to(DEVICE, dtype)
    bias = torch.randn(n, generator=g).to(DEVICE, dtype) if with_bias else None
    y = int4_matmul(x, *weights, bias, group_size=None if act_order else group)
    assert y.shape == (m, n) and y.dtype == dtype
    gemm = m > policy.INT4_GEMV_MAX_ROWS
    assert_near_exact(y, x, weights, bias, weights_rounded=gemm and act_order)


def test_rows_in_order_read_through_g_idx_give_the_same_result():
    """group_size given (the group computed) and None (g_idx read) agree on a checkpoint in row order."""
    weights = gptq_weights(24, 128, 32, False, torch.float32, seed=1)
    x = torch.randn(2, 128).to(DEVICE)
    by_index = int4_matmul(x, *weights)
    assert_near_exact(by_index, x, weights)
    torch.testing.assert_close(int4_matmul(x, *weights, group_size=32), by_index, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("m", [2, 17])
def test_awq_checkpoint_through_the_kernel(m):
    g = torch.Generator().manual_seed(m)
    w = torch.randn(32, 128, generator=g) / 128**0.5
    qweight, scales, zeros, g_idx = awq_to_internal(*quantize_awq(w, 64), 64)
    weights = (
        qweight.to(DEVICE),
        scales.to(DEVICE, torch.bfloat16),
        zeros.to(DEVICE, torch.bfloat16),
        g_idx.to(DEVICE),
    )
    x = torch.randn(m, 128, generator=g).to(DEVICE, torch.bfloat16)
    assert_near_exact(int4_matmul(x, *weights, group_size=64), x, weights)


@pytest.mark.parametrize(
    "config,group",
    [
        (Int4Config(True, 1, 16, 32, 2, 1, 1), 64),  # GEMV, K split in two: partials summed by the second kernel
        (Int4Config(False, 16, 16, 32, 3, 1, 1), 64),  # GEMM, K split in three
        (Int4Config(True, 1, 16, 32, 1, 1, 1), 24),  # tiles of 32 rows over groups of 24: groups per row
        (Int4Config(False, 16, 32, 32, 1, 1, 1), 24),
    ],
)
def test_explicit_configs_split_k_and_groups_across_tiles(config, group):
    m = 4 if config.gemv else 5
    weights = gptq_weights(24, 192, group, False, torch.bfloat16, seed=group)
    g = torch.Generator().manual_seed(7)
    x = torch.randn(m, 192, generator=g).to(DEVICE, torch.bfloat16)
    bias = torch.randn(24, generator=g).to(DEVICE, torch.float32)  # a float32 bias is added as it is
    y = int4_matmul(x, *weights, bias, group_size=group, config=config)
    assert_near_exact(y, x, weights, bias, weights_rounded=not config.gemv)


def test_float16_and_strided_rows():
    weights = gptq_weights(16, 64, 32, True, torch.float16, seed=3)
    wide = torch.randn(3, 128).to(DEVICE, torch.float16)
    x = wide[:, 64:]  # row stride 128, unit column stride
    assert_near_exact(int4_matmul(x, *weights), x, weights)


def test_no_rows():
    weights = gptq_weights(16, 64, 32, False, torch.bfloat16)
    y = int4_matmul(torch.empty(0, 64).to(DEVICE, torch.bfloat16), *weights, group_size=32)
    assert y.shape == (0, 16)


def test_supports_rejects_what_it_cannot_run():
    qweight = torch.zeros(8, 16, dtype=torch.int32, device=DEVICE)
    x = torch.randn(2, 64).to(DEVICE, torch.bfloat16)
    assert supports(x, qweight)
    assert not supports(x[:, :32], qweight)  # K ≠ 8 · packed rows
    assert not supports(x.to(torch.float64), qweight)
    assert not supports(x.view(1, 2, 64), qweight)
    assert not supports(torch.randn(64, 2).to(DEVICE, torch.bfloat16).t(), qweight)  # column stride ≠ 1
    assert not supports(x, qweight.to(torch.int64))
    assert not supports(x, qweight.t().contiguous().t())


def test_rejects_bad_arguments():
    qweight, scales, zeros, g_idx = gptq_weights(16, 64, 32, False, torch.bfloat16)
    x = torch.randn(1, 64).to(DEVICE, torch.bfloat16)
    with pytest.raises(ValueError, match="qweight"):
        int4_matmul(x[:, :32], qweight, scales, zeros, g_idx)
    with pytest.raises(ValueError, match="groups cannot cover"):
        int4_matmul(x, qweight, scales, zeros, g_idx, group_size=16)
    with pytest.raises(ValueError, match="g_idx"):
        int4_matmul(x, qweight, scales, zeros, g_idx.long())
    with pytest.raises(ValueError, match="zeros"):
        int4_matmul(x, qweight, scales, zeros[:, :8], g_idx)
    with pytest.raises(ValueError, match="bias"):
        int4_matmul(x, qweight, scales, zeros, g_idx, torch.zeros(8).to(DEVICE))


# Qwen2-VL-7B (hidden 3584, intermediate 18944, q/k/v heads 28/4/4 of 128) and Yuan2-2B (hidden 2048,
# intermediate 8192): (N, K) of qkv, o, gate_up and down.
MODEL_SHAPES = [(4608, 3584), (3584, 3584), (37888, 3584), (3584, 18944), (6144, 2048), (16384, 2048), (2048, 8192)]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="model shapes: CUDA only")
@pytest.mark.parametrize("n,k", MODEL_SHAPES)
def test_model_shapes_on_cuda(n, k):
    """Random packed words (every nibble value), groups of 128, rows in order and act order, at decode
    and prefill row counts, on the kernels' own configs (K split where the rule splits it)."""
    g = torch.Generator(device="cuda").manual_seed(n + k)
    qweight = torch.randint(-(2**31), 2**31 - 1, (k // 8, n), dtype=torch.int32, device="cuda", generator=g)
    groups = k // 128
    scales = (torch.rand(groups, n, device="cuda", generator=g) * 0.02 + 0.001).to(torch.bfloat16)
    zeros = torch.randint(0, 16, (groups, n), device="cuda", generator=g).to(torch.bfloat16)
    bias = torch.randn(n, device="cuda", generator=g).to(torch.bfloat16)
    for act_order in (False, True):
        rows = torch.randperm(k, device="cuda", generator=g) if act_order else torch.arange(k, device="cuda")
        weights = (qweight, scales, zeros, (rows // 128).to(torch.int32))
        for m in (1, 4, 16, 100):
            x = torch.randn(m, k, device="cuda", generator=g).to(torch.bfloat16)
            y = int4_matmul(x, *weights, bias, group_size=None if act_order else 128)
            assert_near_exact(y, x, weights, bias, weights_rounded=act_order and m > policy.INT4_GEMV_MAX_ROWS)
