"""RMSNorm in Triton, alone or fused with the residual add: one launch where PyTorch runs a chain of
small kernels, with the PyTorch code's numerics (fp32 math inside, rounded to the activation dtype at
the same points).

References: `rms_norm` is `pagoda.layers.norm.rms_norm_reference(x, weight, eps)`, `fused_add_rms_norm`
is `rms_norm_reference(x, weight, eps, residual)`. Where the results can differ: the mean of squares
is a different fp32 summation order than PyTorch's reduction, and 1/sqrt is the hardware
`rsqrt.approx` on the GPU (as in PyTorch's CUDA rms_norm): the normalized value may move by an fp32
ulp, which after rounding to bf16/fp16 flips the last bit of a few elements. The residual sum
`x + residual` is exact (one fp32 add, rounded to the dtype, as PyTorch does), and so is
`weight * normed` (a bf16/fp16 product is exact in fp32).

Launchers check shapes/dtypes/strides and launch; they never read device values on the host. Kernels
may not import layers.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagoda.kernels import pdl
from pagoda.kernels.pdl import wait_for_inputs
from pagoda.kernels.triton_utils import DTYPES, interpreting, load_norm_row, norm_operands, round_to

MAX_NORM_SIZE = 32768  # one program holds a whole row in registers; wider rows use PyTorch


@triton.jit
def rms_weighted(x, weight_ptr, offs, mask, eps, N_COLS: tl.constexpr, out_ptr, EMULATE_BF16: tl.constexpr):
    """weight * round(x * rstd(x)), rounded to out_ptr's dtype: F.rms_norm in fp32 (mean of squares in
    fp32), cast to the dtype, then the weight product (exact in fp32 for bf16/fp16), cast again."""
    xf = x.to(tl.float32)
    variance = tl.math.div_rn(tl.sum(xf * xf, axis=0), N_COLS * 1.0)
    normed = round_to(xf * tl.math.rsqrt(variance + eps), out_ptr, EMULATE_BF16)
    w = tl.load(weight_ptr + offs, mask=mask, other=0.0)
    return round_to(w.to(tl.float32) * normed.to(tl.float32), out_ptr, EMULATE_BF16)


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    summed_ptr,
    stride_x,
    stride_r,
    stride_o,
    stride_s,
    eps,
    N_COLS: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
    EMULATE_BF16: tl.constexpr,
    PDL: tl.constexpr,
):
    """One program per row. With a residual: s = round(x + r) is stored and normed; else x is."""
    wait_for_inputs(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < N_COLS
    x = load_norm_row(
        x_ptr, residual_ptr, summed_ptr, row, stride_x, stride_r, stride_s, offs, mask, HAS_RESIDUAL, EMULATE_BF16
    )
    # out has x's dtype (the launcher allocates it so), so rounding to out's dtype is rounding to x's.
    tl.store(
        out_ptr + row * stride_o + offs,
        rms_weighted(x, weight_ptr, offs, mask, eps, N_COLS, out_ptr, EMULATE_BF16),
        mask=mask,
    )


def supports_rms_norm(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None = None) -> bool:
    """Cases the kernel covers; the layer uses PyTorch for the rest (mixed dtypes, huge rows)."""
    return (
        x.dtype in DTYPES
        and weight.dtype == x.dtype
        and weight.dim() == 1
        and weight.shape[0] == x.shape[-1]
        and 0 < x.shape[-1] <= MAX_NORM_SIZE
        and weight.is_contiguous()
        and weight.device == x.device
        and (
            residual is None
            or (residual.shape == x.shape and residual.dtype == x.dtype and residual.device == x.device)
        )
    )


def _launch_rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    assert supports_rms_norm(x, weight, residual), "unsupported rms_norm arguments"
    out, summed, (x2, r2, out2, s2), (block, num_warps) = norm_operands(x, residual)
    if x2.shape[0] == 0:
        return out, summed
    _rms_norm_kernel[(x2.shape[0],)](
        x2, r2, weight, out2, s2, x2.stride(0), r2.stride(0), out2.stride(0), s2.stride(0), float(eps),
        N_COLS=x.shape[-1], HAS_RESIDUAL=residual is not None, BLOCK=block, EMULATE_BF16=interpreting(),
        num_warps=num_warps, enable_fp_fusion=False, **pdl.launch_args(x),
    )  # fmt: skip
    return out, summed


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * F.rms_norm(x.float(), eps).to(x.dtype), over the last dim of x [..., H]."""
    return _launch_rms_norm(x, weight, eps, None)[0]


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(s), s) with s = x + residual rounded to x.dtype: s is the next residual stream."""
    out, summed = _launch_rms_norm(x, weight, eps, residual)
    assert summed is not None
    return out, summed
