"""The two halves of a W8A8 matmul around `torch._scaled_mm`: per-token FP8 (e4m3) quantization of the
activations, x [M, K] → (q [M, K] e4m3, s [M, 1] fp32), and the scale epilogue, y ← y · s_x[m] · s_w[n] (+ b[n]).

Why: computing the scale and the cast with PyTorch ops is four or five launches per matmul (abs, amax,
divide, clamp, cast), which inside a decode step of ~100 matmuls costs more than the fp8 matmul saves.
Here one program owns one row: it reads the row once for its largest magnitude (fp32), then again
(from L2) to scale, clamp to ±448 and store the e4m3 values.

Why the epilogue: `_scaled_mm` with a scale vector per row and per column runs a CUTLASS kernel that is
slower than the bf16 matmul it replaces on Yuan2-2B-sized weights (about 10 µs for 2048x2048 at any row
count against bf16's 6-7 µs); with unit scalar scales it runs cuBLASLt's fp8 kernel, 0.6-0.7x of bf16
(`benchmarks/kernels/fp8_linear_sweep.py`). So the product is taken unscaled (bf16: a relative
rounding, the same as rounding the scaled result) and both scale vectors and the bias are applied
here in one pass over y.

Numerics: s = max(|x|) / 448 (at least 1e-12), q = round_to_e4m3(clamp(x / s)): the same function as
`pagoda.layers.quantization.fp8.quantize_per_token_reference`, which the tests compare against.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagoda.kernels import pdl
from pagoda.kernels.pdl import wait_for_inputs
from pagoda.kernels.triton_utils import interpreting

# Triton reads module globals inside a kernel only as constexprs.
FP8_MAX = tl.constexpr(448.0)
MIN_SCALE = tl.constexpr(1e-12)


@triton.jit
def _per_token_quant_kernel(
    x_ptr,
    q_ptr,
    s_ptr,
    K,
    stride_xm,
    stride_qm,
    BLOCK_K: tl.constexpr,
    ONE_TILE: tl.constexpr,
    PDL: tl.constexpr,
):
    """Program m: row m. ONE_TILE: K ≤ BLOCK_K, the row stays in registers between the two passes.
    Divisions are `div_rn` (IEEE), as torch divides: Triton's fp32 `/` is PTX's approximate `div.full.f32`."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_K)
    x_row = x_ptr + row * stride_xm
    q_row = q_ptr + row * stride_qm
    wait_for_inputs(PDL)
    if ONE_TILE:
        x = tl.load(x_row + offs, mask=offs < K, other=0.0).to(tl.float32)
        scale = tl.maximum(tl.math.div_rn(tl.max(tl.abs(x), axis=0), FP8_MAX), MIN_SCALE)
        q = tl.clamp(tl.math.div_rn(x, scale), -FP8_MAX, FP8_MAX)
        tl.store(q_row + offs, q.to(q_ptr.dtype.element_ty), mask=offs < K)
    else:
        amax = tl.zeros([BLOCK_K], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + offs
            amax = tl.maximum(amax, tl.abs(tl.load(x_row + k, mask=k < K, other=0.0).to(tl.float32)))
        scale = tl.maximum(tl.math.div_rn(tl.max(amax, axis=0), FP8_MAX), MIN_SCALE)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + offs
            x = tl.load(x_row + k, mask=k < K, other=0.0).to(tl.float32)
            q = tl.clamp(tl.math.div_rn(x, scale), -FP8_MAX, FP8_MAX)
            tl.store(q_row + k, q.to(q_ptr.dtype.element_ty), mask=k < K)
    tl.store(s_ptr + row, scale)


@triton.jit
def _scale_epilogue_kernel(
    y_ptr, sx_ptr, sw_ptr, b_ptr, N, stride_ym, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, PDL: tl.constexpr
):
    """Program (m, j): columns [j·BLOCK_N, (j+1)·BLOCK_N) of row m, in place, in fp32."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = cols < N
    sw = tl.load(sw_ptr + cols, mask=mask, other=0.0)
    wait_for_inputs(PDL)
    y = tl.load(y_ptr + row * stride_ym + cols, mask=mask, other=0.0).to(tl.float32)
    y = y * (tl.load(sx_ptr + row) * sw)
    if HAS_BIAS:
        y += tl.load(b_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * stride_ym + cols, y.to(y_ptr.dtype.element_ty), mask=mask)


def scale_epilogue(y: torch.Tensor, x_scale: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None) -> None:
    """In place: y [M, N] (unit column stride) ← y · x_scale[m] · w_scale[n] (+ bias[n]), in fp32, rounded once."""
    m, n = y.shape
    if m == 0:
        return
    block_n = min(triton.next_power_of_2(n), 64 if interpreting() else 1024)
    _scale_epilogue_kernel[(m, triton.cdiv(n, block_n))](
        y,
        x_scale,
        w_scale,
        bias if bias is not None else w_scale,
        n,
        y.stride(0),
        HAS_BIAS=bias is not None,
        BLOCK_N=block_n,
        num_warps=1 if interpreting() else 4,
        **pdl.launch_args(y),
    )


def supports(x: torch.Tensor) -> bool:
    return x.dtype in (torch.float16, torch.bfloat16, torch.float32) and (x.is_cuda or interpreting())


def per_token_quant(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (unit column stride) → (e4m3 [M, K], float32 [M, 1])."""
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"x must be [M, K] with unit column stride, got {tuple(x.shape)}")
    m, k = x.shape
    q = torch.empty((m, k), dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    if m == 0:
        return q, scale
    limit = 64 if interpreting() else 8192
    block_k = min(triton.next_power_of_2(k), limit)
    _per_token_quant_kernel[(m,)](
        x,
        q,
        scale,
        k,
        x.stride(0),
        q.stride(0),
        BLOCK_K=block_k,
        ONE_TILE=k <= block_k,
        num_warps=1 if interpreting() else (4 if block_k <= 2048 else 8),
        **pdl.launch_args(x),
    )
    return q, scale
