"""The skinny (few-row) GEMM kernel against `F.linear`, computed in float64 as the reference.

Both the kernel and cuBLAS accumulate exact bf16/fp16 products in fp32, in different orders, so
neither is bit-exact against the other; the check is that the kernel is as close to the float64
result as its output dtype allows (one rounding plus fp32 accumulation error). On CPU the kernel runs
under the Triton interpreter (`conftest.py`), so shapes stay small there.
"""

from __future__ import annotations

import platform
import sys

import pytest
import torch
import torch.nn.functional as F

if not (sys.platform == "linux" and platform.machine() == "x86_64"):
    pytest.importorskip("triton")

from pagoda.kernels import skinny_gemm
from pagoda.kernels.skinny_gemm import SkinnyConfig, skinny_linear

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
GPU = DEVICE == "cuda"
DTYPES = [torch.bfloat16, torch.float16]


def _rand(*shape: int, dtype: torch.dtype, seed: int, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype).to(DEVICE)


def _check(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> None:
    ref = F.linear(x.double(), w.double(), None if b is None else b.double())
    assert y.shape == ref.shape and y.dtype == x.dtype
    # One rounding to the output dtype plus fp32 accumulation error, relative to the size of the
    # terms summed. A whole ulp (2^-7 relative for bf16, 2^-10 for fp16), not half: Triton 3.6's
    # interpreter rounds fp32 → bf16 by truncation.
    eps = 2.0 ** -7 if x.dtype == torch.bfloat16 else 2.0 ** -10
    scale = (x.double().abs() @ w.double().abs().T) + (0 if b is None else b.double().abs())
    err = (y.double() - ref).abs()
    assert bool((err <= eps * ref.abs() + 1e-5 * scale + 1e-30).all()), float((err / (scale + 1e-30)).max())


# (M, N, K): rows below, at and above the 16-row tile; N and K not multiples of the tiles; a K
# split that leaves a ragged last split.
CPU_SHAPES = [(1, 16, 32), (3, 40, 96), (16, 48, 64), (17, 33, 70), (5, 16, 200)]
GPU_SHAPES = CPU_SHAPES + [(1, 2048, 2048), (8, 1024, 4096), (32, 2048, 8192), (64, 4096, 2048),
                           (1, 16384, 2048), (7, 3000, 1000)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("m,n,k", GPU_SHAPES if GPU else CPU_SHAPES)
def test_matches_linear(m, n, k, bias, dtype):
    x = _rand(m, k, dtype=dtype, seed=1)
    w = _rand(n, k, dtype=dtype, seed=2, scale=k ** -0.5)
    b = _rand(n, dtype=dtype, seed=3) if bias else None
    _check(skinny_linear(x, w, b), x, w, b)


@pytest.mark.parametrize("split_k", [1, 2, 3, 8])
def test_every_split_gives_the_same_sum(split_k):
    """Explicit configs, including more splits than K tiles (empty trailing splits are dropped)."""
    m, n, k = 4, 48, 160
    x = _rand(m, k, dtype=torch.bfloat16, seed=4)
    w = _rand(n, k, dtype=torch.bfloat16, seed=5, scale=k ** -0.5)
    b = _rand(n, dtype=torch.bfloat16, seed=6)
    cfg = SkinnyConfig(block_n=16, block_k=32, split_k=split_k, num_warps=1 if not GPU else 4,
                       num_stages=1 if not GPU else 3)
    _check(skinny_linear(x, w, b, config=cfg), x, w, b)


def test_leading_dims_and_strided_rows():
    """x [..., K] keeps its leading shape; a row stride wider than K (a slice of a wider tensor) is
    read in place."""
    wide = _rand(6, 100, dtype=torch.bfloat16, seed=7)
    x = wide[:, :64]
    w = _rand(24, 64, dtype=torch.bfloat16, seed=8, scale=0.125)
    y = skinny_linear(x, w)
    _check(y, x, w, None)
    x3 = _rand(2, 3, 64, dtype=torch.bfloat16, seed=9)
    y3 = skinny_linear(x3, w)
    assert y3.shape == (2, 3, 24)
    _check(y3.reshape(6, 24), x3.reshape(6, 64), w, None)


def test_zero_rows_and_supports():
    w = _rand(16, 32, dtype=torch.bfloat16, seed=10)
    assert skinny_linear(torch.empty(0, 32, dtype=torch.bfloat16, device=DEVICE), w).shape == (0, 16)
    x = _rand(2, 32, dtype=torch.bfloat16, seed=11)
    assert skinny_gemm.supports(x, w, max_rows=8)
    assert not skinny_gemm.supports(x, w, max_rows=1)                    # too many rows
    assert not skinny_gemm.supports(x.float(), w.float(), max_rows=8)   # fp32 stays on cuBLAS
    assert not skinny_gemm.supports(x, w.t().contiguous().t(), max_rows=8)   # K not contiguous in W


@pytest.mark.parametrize("m,n,k", [(1, 2048, 2048), (16, 1024, 4096), (64, 2048, 8192), (3, 135040, 2048)])
def test_config_rule_fills_the_gpu(m, n, k):
    """The rule gives every K split at least one tile and, for narrow N, enough programs for 132 SMs."""
    cfg = skinny_gemm.skinny_config(m, n, k, num_sms=132)
    if skinny_gemm._interpreting():
        pytest.skip("the interpreter uses a fixed tiny config")
    programs = -(-n // cfg.block_n) * cfg.split_k
    assert cfg.split_k * cfg.block_k <= k
    assert programs >= 132
