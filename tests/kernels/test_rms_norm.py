"""RMSNorm and add + RMSNorm (`pagoda/kernels/rms_norm.py`) against `rms_norm_reference`, the layer's
PyTorch code (what the CPU runs and what the model goldens pin down). The residual sum is bit-exact;
the normed value is within an ulp (RMSNorm's fp32 reduction order). On CPU the kernels run under the
Triton interpreter (`conftest.py`), so shapes stay tiny.
"""

from __future__ import annotations

import platform
import sys

import pytest
import torch

if not (sys.platform == "linux" and platform.machine() == "x86_64"):
    pytest.importorskip("triton")

from pagoda.kernels import rms_norm as norm_kernels
from pagoda.layers.norm import rms_norm_reference
from tests.kernels.fused_checks import DTYPES, check_normed, randn

NORM_SHAPES = [(1, 8), (3, 33), (4, 100), (2, 257)]  # (rows, hidden); odd and non-power-of-2 hiddens


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows,hidden", NORM_SHAPES)
def test_rms_norm(rows, hidden, dtype):
    x = randn(rows, hidden, dtype=dtype, scale=3.0, seed=1)
    weight = randn(hidden, dtype=dtype, seed=2) + 1
    out = norm_kernels.rms_norm(x, weight, 1e-6)
    ref = rms_norm_reference(x, weight, 1e-6)
    assert out.dtype == dtype and out.shape == x.shape
    check_normed(out, ref)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows,hidden", NORM_SHAPES)
def test_fused_add_rms_norm(rows, hidden, dtype):
    x = randn(rows, hidden, dtype=dtype, scale=2.0, seed=3)
    residual = randn(rows, hidden, dtype=dtype, scale=5.0, seed=4)
    weight = randn(hidden, dtype=dtype, seed=5) + 1
    out, summed = norm_kernels.fused_add_rms_norm(x, residual, weight, 1e-5)
    ref_out, ref_summed = rms_norm_reference(x, weight, 1e-5, residual)
    assert torch.equal(summed, ref_summed)  # the next residual stream: exactly `x + residual`
    assert torch.equal(summed, residual + x)  # the order the model used to add in
    check_normed(out, ref_out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_rms_norm_strided_and_batched_inputs(dtype):
    wide = randn(5, 80, dtype=dtype, seed=6)
    x = wide[:, 8:56]  # rows strided by 80
    residual = randn(2, 5, 48, dtype=dtype, seed=7)[1]  # a view into a bigger tensor
    weight = randn(48, dtype=dtype, seed=8)
    out, summed = norm_kernels.fused_add_rms_norm(x, residual, weight, 1e-6)
    ref_out, ref_summed = rms_norm_reference(x, weight, 1e-6, residual)
    assert torch.equal(summed, ref_summed)
    check_normed(out, ref_out)
    x3 = randn(2, 3, 48, dtype=dtype, seed=9)  # [..., H]
    check_normed(norm_kernels.rms_norm(x3, weight, 1e-6), rms_norm_reference(x3, weight, 1e-6))
    assert norm_kernels.rms_norm(x3[:0], weight, 1e-6).shape == (0, 3, 48)
