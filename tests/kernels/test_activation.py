"""SiLU-and-mul and QuickGELU (`pagoda/kernels/activation.py`) against the layer's PyTorch code: the
bf16/fp16 rounding points are the same; under the interpreter NumPy's `exp` against PyTorch's (Sleef)
on the CPU may differ by an fp32 ulp. On CPU the kernels run under the Triton interpreter
(`conftest.py`), so shapes stay tiny.
"""

from __future__ import annotations

import platform
import sys

import pytest
import torch

if not (sys.platform == "linux" and platform.machine() == "x86_64"):
    pytest.importorskip("triton")

from pagoda.kernels import activation as activation_kernels
from pagoda.layers.activation import quick_gelu_reference, silu_and_mul_reference
from tests.kernels.fused_checks import DTYPES, randn, ulps

# SiLU of ±100 overflows exp under the interpreter (NumPy warns; the result, inf → silu = -0, is right).
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")


SILU_SHAPES = [(1, 1), (3, 5), (4, 64), (2, 37), (1, 1100)]  # (rows, I); 1100 > one column block


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows,inter", SILU_SHAPES)
def test_silu_and_mul(rows, inter, dtype):
    x = randn(rows, 2 * inter, dtype=dtype, scale=4.0, seed=14)
    x[0, 0] = -100.0  # exp overflows: silu = -0
    x[-1, min(1, inter - 1)] = 100.0
    out = activation_kernels.silu_and_mul(x)
    ref = silu_and_mul_reference(x)
    assert out.shape == (rows, inter) and out.dtype == dtype
    # Same rounding points (silu rounded to the dtype, then the product); only `exp` may differ by
    # an fp32 ulp or two (the CPU reference vectorises exp and the division its own way; on the GPU
    # both are expf and an IEEE division).
    assert ulps(out, ref) <= (4 if dtype == torch.float32 else 1)
    if dtype != torch.float32:
        assert (out != ref).float().mean() <= 0.02


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_silu_and_mul_strided_rows_and_column_blocks(dtype, monkeypatch):
    monkeypatch.setattr(activation_kernels, "_SILU_BLOCK", 8)  # I = 21 → three column blocks, the last partial
    x = randn(3, 50, dtype=dtype, seed=15)[:, 4:46]  # [3, 42], rows strided by 50
    out = activation_kernels.silu_and_mul(x)
    # fp32: exp is not correctly rounded on either side (NumPy under the interpreter, Sleef or CUDA's
    # exp in PyTorch), so a couple of fp32 ulps, as in test_silu_and_mul; bf16 rounds that away
    limit = 4 if dtype == torch.float32 else 1
    assert ulps(out, silu_and_mul_reference(x)) <= limit
    x3 = randn(2, 2, 10, dtype=dtype, seed=16)
    assert ulps(activation_kernels.silu_and_mul(x3), silu_and_mul_reference(x3)) <= limit
    assert activation_kernels.silu_and_mul(x3[:0]).shape == (0, 2, 5)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_quick_gelu_matches_reference(dtype):
    """The vision tower's QuickGELU in one pass against PyTorch's three ops: rounded at the same points, so
    equal up to the sigmoid's last fp32 ulp (the interpreter's NumPy exp against PyTorch's vectorised one),
    which a 16-bit rounding hides almost always."""
    x = randn(3, 1000 + 37, dtype=dtype, scale=4.0, seed=31)  # several programs, a ragged tail
    out = activation_kernels.quick_gelu(x)
    ref = quick_gelu_reference(x)
    assert out.shape == x.shape and out.dtype == dtype
    tol = {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}[dtype]
    torch.testing.assert_close(out, ref, rtol=tol, atol=tol)
    if dtype != torch.float32:
        assert (out == ref).float().mean() > 0.99  # rounded where the reference rounds: nearly all bits equal
    assert activation_kernels.quick_gelu(x[:0]).shape == (0, 1037)
