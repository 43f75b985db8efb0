"""Activations in one Triton launch each: SiLU-and-mul (the decoder MLP's) and QuickGELU (the Qwen2-VL
vision MLP's), with PyTorch's rounding points.

References: `silu_and_mul` is `pagoda.layers.activation.silu_and_mul_reference(x)`, `quick_gelu` is
`quick_gelu_reference(x)`. SiLU uses libdevice's `expf` and a correctly rounded division on the GPU
(PyTorch's CUDA silu is `x / (1 + expf(-x))` in fp32), so it should agree bit for bit there; under
the interpreter `exp` is NumPy's (in float64, rounded) and the CPU reference's is Sleef's: they may
differ by an fp32 ulp.

Launchers check shapes/dtypes/strides and launch; they never read device values on the host. Kernels
may not import layers.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from pagoda.kernels import pdl
from pagoda.kernels.pdl import wait_for_inputs
from pagoda.kernels.triton_utils import DTYPES, interpreting, round_to, rows_2d

_SILU_BLOCK = 1024  # columns per SiLU-and-mul program (elements per QuickGELU program)


@triton.jit
def _silu_and_mul_kernel(
    x_ptr,
    out_ptr,
    stride_x,
    stride_o,
    n_cols,
    BLOCK: tl.constexpr,
    PRECISE_EXP: tl.constexpr,
    EMULATE_BF16: tl.constexpr,
    PDL: tl.constexpr,
):
    """Grid (T, cdiv(I, BLOCK)): out[t, i] = round(round(silu(x[t, i])) * x[t, I + i])."""
    wait_for_inputs(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_cols
    gate = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * stride_x + n_cols + offs, mask=mask, other=0.0)
    tl.store(out_ptr + row * stride_o + offs, silu_mul(gate, up, out_ptr, PRECISE_EXP, EMULATE_BF16), mask=mask)


@triton.jit
def silu_mul(gate, up, out_ptr, PRECISE_EXP: tl.constexpr, EMULATE_BF16: tl.constexpr):
    """round(round(F.silu(gate)) * up) in out_ptr's dtype, from gate and up in that dtype (also
    the few-row GEMV's epilogue, `pagoda/kernels/gemv.py`, which must round exactly like this)."""
    gate = gate.to(tl.float32)
    if PRECISE_EXP:
        e = libdevice.exp(-gate)  # expf, as PyTorch's CUDA silu (tl.exp would be ex2.approx)
    else:
        # The interpreter has no libdevice, and NumPy's float32 exp is a few ulps off; its float64
        # exp rounded to fp32 is (nearly always) the correctly rounded expf, as CUDA's and Sleef's are.
        e = tl.exp(-gate.to(tl.float64)).to(tl.float32)
    silu = round_to(tl.math.div_rn(gate, 1.0 + e), out_ptr, EMULATE_BF16)  # F.silu(gate), rounded
    out = silu.to(tl.float32) * up.to(tl.float32)  # * up, rounded again
    return round_to(out, out_ptr, EMULATE_BF16)


def supports_silu_and_mul(x: torch.Tensor) -> bool:
    return x.dtype in DTYPES and x.dim() >= 1 and x.shape[-1] % 2 == 0 and x.shape[-1] > 0


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [..., 2I] laid out [gate | up] → F.silu(gate) * up [..., I], in x.dtype."""
    assert supports_silu_and_mul(x), "unsupported silu_and_mul arguments"
    n_cols = x.shape[-1] // 2
    x2 = rows_2d(x)
    out = torch.empty((*x.shape[:-1], n_cols), dtype=x.dtype, device=x.device)
    out2 = out.view(-1, n_cols)
    if x2.shape[0] == 0:
        return out
    block = min(triton.next_power_of_2(n_cols), _SILU_BLOCK)
    _silu_and_mul_kernel[(x2.shape[0], triton.cdiv(n_cols, block))](
        x2,
        out2,
        x2.stride(0),
        out2.stride(0),
        n_cols,
        BLOCK=block,
        PRECISE_EXP=not interpreting(),
        EMULATE_BF16=interpreting(),
        num_warps=4,
        enable_fp_fusion=False,
        **pdl.launch_args(x),
    )
    return out


@triton.jit
def _quick_gelu_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr, PRECISE_EXP: tl.constexpr, EMULATE_BF16: tl.constexpr):
    """Grid (cdiv(n, BLOCK),) over a contiguous tensor: out = x * sigmoid(1.702 x), rounded to x's dtype
    at the same three points as PyTorch's three launches (the product 1.702 x, the sigmoid, the result)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    t = round_to(x * 1.702, out_ptr, EMULATE_BF16).to(tl.float32)
    if PRECISE_EXP:
        e = libdevice.exp(-t)  # expf, as PyTorch's CUDA sigmoid
    else:  # the interpreter: see silu_mul
        e = tl.exp(-t.to(tl.float64)).to(tl.float32)
    sig = round_to(tl.math.div_rn(1.0, 1.0 + e), out_ptr, EMULATE_BF16).to(tl.float32)
    tl.store(out_ptr + offs, round_to(x * sig, out_ptr, EMULATE_BF16), mask=mask)


def supports_quick_gelu(x: torch.Tensor) -> bool:
    return x.dtype in DTYPES and x.is_contiguous()


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    """x * sigmoid(1.702 x) (the Qwen2-VL vision MLP's activation) in one pass over a contiguous x."""
    assert supports_quick_gelu(x), "unsupported quick_gelu arguments"
    out = torch.empty_like(x)
    n = x.numel()
    if n == 0:
        return out
    _quick_gelu_kernel[(triton.cdiv(n, _SILU_BLOCK),)](
        x,
        out,
        n,
        BLOCK=_SILU_BLOCK,
        PRECISE_EXP=not interpreting(),
        EMULATE_BF16=interpreting(),
        num_warps=4,
        enable_fp_fusion=False,
    )
    return out
