"""The tiled Triton GEMM against `torch.nn.functional.linear` (fp32 reference of the same operands).

Not bit-exact: fp32 accumulation in a different order than cuBLAS, so the tolerance is a few bf16
ulps of the output scale. On CPU the kernel runs under the Triton interpreter (conftest.py), so the
shapes are tiny but cover ragged M/N/K tails, the K split with its reduce, bias, strided x rows and
a caller-provided output.
"""

from __future__ import annotations

import platform
import sys

import pytest
import torch
import torch.nn.functional as F

if not (sys.platform == "linux" and platform.machine() == "x86_64"):
    pytest.importorskip("triton")

from pagoda.kernels.tiled_gemm import GemmConfig, supports, tiled_linear

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def reference(x, w, b):
    return F.linear(x.float(), w.float(), None if b is None else b.float())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m,n,k", [(1, 16, 32), (20, 48, 96), (33, 40, 80)])
@pytest.mark.parametrize("split", [1, 2, 3])
@pytest.mark.parametrize("has_bias", [False, True])
def test_matches_linear(dtype, m, n, k, split, has_bias):
    g = torch.Generator().manual_seed(m * 1000 + n * 10 + k + split)
    x = torch.randn(m, k, generator=g).to(dtype).to(DEVICE)
    w = (torch.randn(n, k, generator=g) * k ** -0.5).to(dtype).to(DEVICE)
    b = torch.randn(n, generator=g).to(dtype).to(DEVICE) if has_bias else None
    cfg = GemmConfig(block_m=16, block_n=16, block_k=32, split_k=split, num_warps=1, num_stages=1)
    got = tiled_linear(x, w, b, cfg)
    want = reference(x, w, b)
    assert got.shape == (m, n) and got.dtype == dtype
    # fp32 accumulation of exact products, rounded once to the output dtype: within 2 output ulps.
    ulp = 2.0 ** -7 if dtype == torch.bfloat16 else 2.0 ** -10
    tol = 2 * ulp * want.abs().clamp_min(1.0)
    assert ((got.float() - want).abs() <= tol).all()


def test_strided_rows_leading_dims_and_out():
    g = torch.Generator().manual_seed(7)
    base = torch.randn(2, 5, 96, generator=g).to(torch.bfloat16).to(DEVICE)
    x = base[..., :64]                              # rows strided by 96
    w = (torch.randn(24, 64, generator=g) * 0.125).to(torch.bfloat16).to(DEVICE)
    cfg = GemmConfig(block_m=16, block_n=16, block_k=32, split_k=2, num_warps=1, num_stages=1)
    got = tiled_linear(x, w, None, cfg)
    assert got.shape == (2, 5, 24)
    want = reference(x, w, None)
    assert ((got.float() - want).abs() <= 2 * 2.0 ** -7 * want.abs().clamp_min(1.0)).all()
    out_base = torch.zeros(10, 40, dtype=torch.bfloat16, device=DEVICE)
    out = out_base[:, 8:32]                         # a column window of a wider buffer
    tiled_linear(x.reshape(10, 64), w, None, cfg, out=out)
    assert torch.equal(out, got.reshape(10, 24))
    assert (out_base[:, :8] == 0).all() and (out_base[:, 32:] == 0).all()


def test_supports():
    w = torch.zeros(8, 16, dtype=torch.bfloat16, device=DEVICE)
    assert supports(torch.zeros(3, 16, dtype=torch.bfloat16, device=DEVICE), w)
    assert not supports(torch.zeros(3, 16, dtype=torch.float32, device=DEVICE), w)
    assert not supports(torch.zeros(3, 8, dtype=torch.bfloat16, device=DEVICE), w)
    assert not supports(torch.zeros(0, 16, dtype=torch.bfloat16, device=DEVICE), w)
