"""Helpers every Triton kernel family shares: whether kernels run under Triton's interpreter, rounding
to a tensor's dtype as the GPU rounds, tensor-core products that the interpreter computes right, and
the 2-D row view the row-wise launchers take.

Kernels hand strides around as tuples (`t.stride()`, indexed inside the kernel): Triton specialises
each element of a tuple argument as it does a scalar one (unit strides and multiples of 16 become
constants), so one tuple argument compiles to the same code as one argument per stride.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagoda import envs

DTYPES = (torch.float16, torch.bfloat16, torch.float32)  # the activation dtypes the kernels take


def interpreting() -> bool:
    """Whether `@triton.jit` kernels run under Triton's interpreter (TRITON_INTERPRET=1, CPU tensors)."""
    return envs.TRITON_INTERPRET.value


def rows_2d(t: torch.Tensor) -> torch.Tensor:
    """[..., H] as [N, H] with unit stride along H (a view when possible)."""
    t2 = t.reshape(-1, t.shape[-1])
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def norm_operands(
    x: torch.Tensor, residual: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor | None, tuple[torch.Tensor, ...], tuple[int, int]]:
    """What a one-program-per-row norm kernel (RMSNorm, LayerNorm; + the residual add) over x [..., H] reads and
    writes: (out, summed — None without a residual —, the [N, H] row views (x, residual, out, summed), with x's and
    out's standing in for the missing residual's and summed's, and the launch's (BLOCK, num_warps))."""
    n_cols = x.shape[-1]
    x2 = rows_2d(x)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    out2 = out.view(-1, n_cols)
    summed = torch.empty_like(out) if residual is not None else None
    r2 = rows_2d(residual) if residual is not None else x2
    s2 = summed.view(-1, n_cols) if summed is not None else out2
    block = triton.next_power_of_2(n_cols)
    return out, summed, (x2, r2, out2, s2), (block, min(max(block // 512, 1), 16))


@triton.jit
def round_to(x, ptr, EMULATE_BF16: tl.constexpr):
    """fp32 x rounded to ptr's element type, to nearest even, as the GPU's `cvt.rn` and PyTorch do.

    EMULATE_BF16 (the interpreter only): Triton 3.6's interpreter casts fp32 → bf16 by truncating,
    so round the fp32 bits to nearest even by hand first; the cast that follows is then exact."""
    if EMULATE_BF16:
        if ptr.dtype.element_ty == tl.bfloat16:
            bits = x.to(tl.uint32, bitcast=True)
            bits = bits + 0x7FFF + ((bits >> 16) & 1)
            x = ((bits >> 16) << 16).to(tl.float32, bitcast=True)
    return x.to(ptr.dtype.element_ty)


@triton.jit
def load_norm_row(
    x_ptr,
    residual_ptr,
    summed_ptr,
    row,
    stride_x,
    stride_r,
    stride_s,
    offs,
    mask,
    HAS_RESIDUAL: tl.constexpr,
    EMULATE_BF16: tl.constexpr,
):
    """A norm kernel's input row (the launch shape of `norm_operands`): x, or with a residual s = round(x + r)
    in x's dtype (rounded like `x + r`), which is stored as the next residual stream and returned."""
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + offs, mask=mask, other=0.0)
        x = round_to(x.to(tl.float32) + r.to(tl.float32), x_ptr, EMULATE_BF16)
        tl.store(summed_ptr + row * stride_s + offs, x, mask=mask)
    return x


def dot_flags(dtype: torch.dtype) -> tuple[bool, bool]:
    """(IEEE, UPCAST) constexprs for `mma`.

    IEEE: fp32 inputs use exact fp32 products, not TF32 (which would be ~1e-3 off the reference).
    UPCAST: Triton 3.6's interpreter computes bf16 `tl.dot` wrong (it treats the raw bits as
    integers), so under the interpreter bf16 operands are widened to fp32 first. bf16 products are
    exact in fp32 and MMA accumulates in fp32, so this matches the GPU's numerics."""
    return dtype == torch.float32, dtype == torch.bfloat16 and interpreting()


@triton.jit
def mma(a, b, IEEE: tl.constexpr, UPCAST: tl.constexpr):
    """a [M, K] @ b [K, N] → fp32 [M, N]."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    elif IEEE:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b)
