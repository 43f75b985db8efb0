"""Per-token FP8 (e4m3) quantization of activations in one launch: x [M, K] → (q [M, K] e4m3, s [M, 1] fp32).

Why: `torch._scaled_mm` multiplies fp8 operands with a scale per row of x; computing that scale and
the cast with PyTorch ops is four or five launches per matmul (abs, amax, divide, clamp, cast), which
inside a decode step of ~100 matmuls costs more than the fp8 matmul saves. Here one program owns
one row: it reads the row once for its largest magnitude (fp32), then again (from L2) to scale,
clamp to ±448 and store the e4m3 values.

Numerics: s = max(|x|) / 448 (at least 1e-12), q = round_to_e4m3(clamp(x / s)): the same function as
`pagoda.layers.quantization.fp8.quantize_per_token_reference`, which the tests compare against.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagoda.kernels import pdl
from pagoda.kernels.fused_ops import _interpreting
from pagoda.kernels.pdl import wait_for_inputs

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
    """Program m: row m. ONE_TILE: K ≤ BLOCK_K, the row stays in registers between the two passes."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_K)
    x_row = x_ptr + row * stride_xm
    q_row = q_ptr + row * stride_qm
    wait_for_inputs(PDL)
    if ONE_TILE:
        x = tl.load(x_row + offs, mask=offs < K, other=0.0).to(tl.float32)
        scale = tl.maximum(tl.max(tl.abs(x), axis=0) / FP8_MAX, MIN_SCALE)
        q = tl.clamp(x / scale, -FP8_MAX, FP8_MAX)
        tl.store(q_row + offs, q.to(q_ptr.dtype.element_ty), mask=offs < K)
    else:
        amax = tl.zeros([BLOCK_K], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + offs
            amax = tl.maximum(amax, tl.abs(tl.load(x_row + k, mask=k < K, other=0.0).to(tl.float32)))
        scale = tl.maximum(tl.max(amax, axis=0) / FP8_MAX, MIN_SCALE)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + offs
            x = tl.load(x_row + k, mask=k < K, other=0.0).to(tl.float32)
            q = tl.clamp(x / scale, -FP8_MAX, FP8_MAX)
            tl.store(q_row + k, q.to(q_ptr.dtype.element_ty), mask=k < K)
    tl.store(s_ptr + row, scale)


def supports(x: torch.Tensor) -> bool:
    return x.dtype in (torch.float16, torch.bfloat16, torch.float32) and (x.is_cuda or _interpreting())


def per_token_quant(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (unit column stride) → (e4m3 [M, K], float32 [M, 1])."""
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"x must be [M, K] with unit column stride, got {tuple(x.shape)}")
    m, k = x.shape
    q = torch.empty((m, k), dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    if m == 0:
        return q, scale
    limit = 64 if _interpreting() else 8192
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
        num_warps=1 if _interpreting() else (4 if block_k <= 2048 else 8),
        **pdl.launch_args(x),
    )
    return q, scale
