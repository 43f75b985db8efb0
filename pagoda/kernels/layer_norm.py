"""LayerNorm in Triton, alone or fused with the residual add before it (the Qwen2-VL vision tower's pre-norm
blocks): one launch where PyTorch runs an add and its LayerNorm kernel, with PyTorch's numerics (statistics and
the affine map in fp32, rounded once to the activation dtype).

Why: in the Qwen2-VL-2B image steps the tower's adds and LayerNorms were ~4.5 % of the GPU's time, and PyTorch's
bf16 LayerNorm moved its bytes at ~1.8 TB/s against its add's ~4.6 (an H200 kernel table,
`benchmarks/profile/image_step_profile.py --kernels`). Fused, a block's residual stream is read once per norm
instead of twice and the add's launch goes; `benchmarks/profile/vision_tower_profile.py` times the tower with and
without (`PAGODA_FUSED_OPS=0`).

References: `layer_norm` is `pagoda.layers.norm.layer_norm_reference(x, weight, bias, eps)`,
`fused_add_layer_norm` is the same with `residual`. Where the results can differ: the mean and variance are
summed in another fp32 order than PyTorch's (two passes over the row held in registers, against its Welford
updates), and 1/sqrt is the GPU's `rsqrt`: the normalized value may move by an fp32 ulp, which after rounding to
bf16/fp16 flips the last bit of a few elements. The residual sum `x + residual` is exact (one fp32 add, rounded
to the dtype, as PyTorch's add does).

Launchers check shapes/dtypes/strides and launch; they never read device values on the host.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagoda.kernels import pdl
from pagoda.kernels.pdl import wait_for_inputs
from pagoda.kernels.triton_utils import DTYPES, interpreting, load_norm_row, norm_operands, round_to

MAX_NORM_SIZE = 16384  # one program holds a whole row in registers; wider rows use PyTorch


@triton.jit
def _layer_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    bias_ptr,
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
    """One program per row. With a residual: s = round(x + r) is stored and normed; else x is.
    out = (v - mean) · rstd · w + b over the row v, in fp32, rounded once (PyTorch's formula)."""
    wait_for_inputs(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < N_COLS
    x = load_norm_row(
        x_ptr, residual_ptr, summed_ptr, row, stride_x, stride_r, stride_s, offs, mask, HAS_RESIDUAL, EMULATE_BF16
    )
    v = x.to(tl.float32)
    mean = tl.sum(v, axis=0) / N_COLS
    centered = tl.where(mask, v - mean, 0.0)
    rstd = tl.math.rsqrt(tl.sum(centered * centered, axis=0) / N_COLS + eps)
    w = tl.load(weight_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(bias_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    # out has x's dtype (the launcher allocates it so), so rounding to out's dtype is rounding to x's.
    tl.store(out_ptr + row * stride_o + offs, round_to(centered * rstd * w + b, out_ptr, EMULATE_BF16), mask=mask)


def supports_layer_norm(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor | None = None
) -> bool:
    """Cases the kernel covers; the layer uses PyTorch for the rest (mixed dtypes, no bias, huge rows)."""
    return (
        x.dtype in DTYPES
        and bias is not None
        and all(p.dtype == x.dtype and p.dim() == 1 and p.shape[0] == x.shape[-1] for p in (weight, bias))
        and 0 < x.shape[-1] <= MAX_NORM_SIZE
        and weight.is_contiguous()
        and bias.is_contiguous()
        and weight.device == x.device == bias.device
        and (
            residual is None
            or (residual.shape == x.shape and residual.dtype == x.dtype and residual.device == x.device)
        )
    )


def _launch(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float, residual: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    assert supports_layer_norm(x, weight, bias, residual), "unsupported layer_norm arguments"
    out, summed, (x2, r2, out2, s2), (block, num_warps) = norm_operands(x, residual)
    if x2.shape[0] == 0:
        return out, summed
    _layer_norm_kernel[(x2.shape[0],)](
        x2, r2, weight, bias, out2, s2, x2.stride(0), r2.stride(0), out2.stride(0), s2.stride(0), float(eps),
        N_COLS=x.shape[-1], HAS_RESIDUAL=residual is not None, BLOCK=block, EMULATE_BF16=interpreting(),
        num_warps=num_warps, enable_fp_fusion=False, **pdl.launch_args(x),
    )  # fmt: skip
    return out, summed


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    """F.layer_norm(x, (H,), weight, bias, eps) over the last dim of x [..., H]."""
    return _launch(x, weight, bias, eps, None)[0]


def fused_add_layer_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(layer_norm(s), s) with s = x + residual rounded to x.dtype: s is the next residual stream."""
    out, summed = _launch(x, weight, bias, eps, residual)
    assert summed is not None
    return out, summed
