"""Fused elementwise kernels for the decoder layers: RMSNorm (alone, or fused with the residual add),
neox-style RoPE for q and k in one launch, SiLU-and-mul, and Yuan2's LF gate on decode steps.

Each replaces a chain of small PyTorch kernels (a decode step of a 2B model spent ~70 launches per
layer on them) with one launch, and keeps the PyTorch code's numerics: fp32 math inside, rounded to
the activation dtype at the same points. The PyTorch references are the layers' own CPU paths:

| kernel | reference |
| --- | --- |
| `rms_norm` | `pagoda.layers.norm.rms_norm_reference(x, weight, eps)` |
| `fused_add_rms_norm` | `pagoda.layers.norm.rms_norm_reference(x, weight, eps, residual)` |
| `rotary` | `pagoda.layers.rotary.apply_rotary_reference(q, k, (cos, sin))` |
| `rotary_store_kv` | `rotary`, then `paged_attention.store_kv` (the Triton backend's KV store; fp8 caches too) |
| `silu_and_mul` | `pagoda.layers.activation.silu_and_mul_reference(x)` |
| `lf_decode_input` / `lf_decode_output` | the layernorms plus `LocalizedFilter`'s PyTorch path (pure copies) |

Where the results can differ from the reference (everything else is bit-identical):
- RMSNorm's mean of squares is a different fp32 summation order than PyTorch's reduction, and
  1/sqrt is the hardware `rsqrt.approx` on the GPU (as in PyTorch's CUDA rms_norm): the normalized
  value may move by an fp32 ulp, which after rounding to bf16/fp16 flips the last bit of a few
  elements. The residual sum `x + residual` is exact (one fp32 add, rounded to the dtype, as
  PyTorch does), and so is `weight * normed` (a bf16/fp16 product is exact in fp32).
- SiLU uses libdevice's `expf` and a correctly rounded division on the GPU (PyTorch's CUDA silu is
  `x / (1 + expf(-x))` in fp32), so it should agree bit for bit there; under the interpreter `exp`
  is NumPy's (in float64, rounded) and the CPU reference's is Sleef's: they may differ by an fp32
  ulp.
- RoPE: `x1 * cos - x2 * sin` as three rounded fp32 operations, like PyTorch's eager ops — the
  kernels are launched with `enable_fp_fusion=False`, so no multiply-add is contracted into an FMA.

Launchers check shapes/dtypes/strides and launch; they never read device values on the host. Kernels
may not import layers.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from pagoda import envs
from pagoda.kernels import pdl
from pagoda.kernels.paged_attention import FP8, store_value
from pagoda.kernels.pdl import wait_for_inputs

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_NORM_SIZE = 32768  # one program holds a whole row in registers; wider rows use PyTorch
_ROPE_TILE = 1024  # elements of one RoPE program's [heads, R/2] tile (caps heads per program)
_SILU_BLOCK = 1024  # columns per SiLU-and-mul program (elements per QuickGELU program)


def _interpreting() -> bool:
    return envs.TRITON_INTERPRET.value


@triton.jit
def _round_to(x, ptr, EMULATE_BF16: tl.constexpr):
    """fp32 x rounded to ptr's element type, to nearest even, as the GPU's `cvt.rn` and PyTorch do.

    EMULATE_BF16 (the interpreter only): Triton 3.6's interpreter casts fp32 → bf16 by truncating,
    so round the fp32 bits to nearest even by hand first; the cast that follows is then exact."""
    if EMULATE_BF16:
        if ptr.dtype.element_ty == tl.bfloat16:
            bits = x.to(tl.uint32, bitcast=True)
            bits = bits + 0x7FFF + ((bits >> 16) & 1)
            x = ((bits >> 16) << 16).to(tl.float32, bitcast=True)
    return x.to(ptr.dtype.element_ty)


# ---------------------------------------------------------------------------------------------
# RMSNorm, optionally fused with the residual add
# ---------------------------------------------------------------------------------------------


@triton.jit
def _rms_weighted(x, weight_ptr, offs, mask, eps, N_COLS: tl.constexpr, out_ptr, EMULATE_BF16: tl.constexpr):
    """weight * round(x * rstd(x)), rounded to out_ptr's dtype: F.rms_norm in fp32 (mean of squares in
    fp32), cast to the dtype, then the weight product (exact in fp32 for bf16/fp16), cast again."""
    xf = x.to(tl.float32)
    variance = tl.math.div_rn(tl.sum(xf * xf, axis=0), N_COLS * 1.0)
    normed = _round_to(xf * tl.math.rsqrt(variance + eps), out_ptr, EMULATE_BF16)
    w = tl.load(weight_ptr + offs, mask=mask, other=0.0)
    return _round_to(w.to(tl.float32) * normed.to(tl.float32), out_ptr, EMULATE_BF16)


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
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + offs, mask=mask, other=0.0)
        x = _round_to(x.to(tl.float32) + r.to(tl.float32), x_ptr, EMULATE_BF16)  # rounded like `x + r`
        tl.store(summed_ptr + row * stride_s + offs, x, mask=mask)
    # out has x's dtype (the launcher allocates it so), so rounding to out's dtype is rounding to x's.
    tl.store(
        out_ptr + row * stride_o + offs,
        _rms_weighted(x, weight_ptr, offs, mask, eps, N_COLS, out_ptr, EMULATE_BF16),
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


def _rows(t: torch.Tensor) -> torch.Tensor:
    """[..., H] as [N, H] with unit stride along H (a view when possible)."""
    t2 = t.reshape(-1, t.shape[-1])
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def _launch_rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    assert supports_rms_norm(x, weight, residual), "unsupported rms_norm arguments"
    n_cols = x.shape[-1]
    x2 = _rows(x)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    out2 = out.view(-1, n_cols)
    r2 = _rows(residual) if residual is not None else x2
    summed = torch.empty_like(out) if residual is not None else None
    s2 = summed.view(-1, n_cols) if summed is not None else out2
    n_rows = x2.shape[0]
    if n_rows == 0:
        return out, summed
    block = triton.next_power_of_2(n_cols)
    _rms_norm_kernel[(n_rows,)](
        x2,
        r2,
        weight,
        out2,
        s2,
        x2.stride(0),
        r2.stride(0),
        out2.stride(0),
        s2.stride(0),
        float(eps),
        N_COLS=n_cols,
        HAS_RESIDUAL=residual is not None,
        BLOCK=block,
        EMULATE_BF16=_interpreting(),
        num_warps=min(max(block // 512, 1), 16),
        enable_fp_fusion=False,
        **pdl.launch_args(x),
    )
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


# ---------------------------------------------------------------------------------------------
# RoPE (neox / rotate-half layout), q and k in one launch
# ---------------------------------------------------------------------------------------------


@triton.jit
def _rope_heads(
    src,
    dst,
    stride_src_h,
    stride_dst_h,
    head0,
    num_heads,
    cos,
    sin,
    HALF: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_PASS: tl.constexpr,
    EMULATE_BF16: tl.constexpr,
    scale,
    FP8_CACHE: tl.constexpr,
):
    """Rotate heads [head0, head0 + BLOCK_H) of one token: src/dst point at the token's head 0.
    The rotated values are rounded to src's dtype, then stored as dst holds them (FP8_CACHE: an fp8
    KV cache, quantized with `scale` exactly as `paged_attention.store_kv` quantizes that rounded k)."""
    offs_h = head0 + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_HALF)
    mask_h = offs_h < num_heads
    mask = mask_h[:, None] & (offs_d[None, :] < HALF)
    src_rows = src + offs_h[:, None].to(tl.int64) * stride_src_h
    dst_rows = dst + offs_h[:, None].to(tl.int64) * stride_dst_h
    x1 = tl.load(src_rows + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src_rows + HALF + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
    o1 = x1 * cos[None, :] - x2 * sin[None, :]
    o2 = x2 * cos[None, :] + x1 * sin[None, :]
    o1 = store_value(_round_to(o1, src, EMULATE_BF16), scale, dst, FP8_CACHE, EMULATE_BF16)
    o2 = store_value(_round_to(o2, src, EMULATE_BF16), scale, dst, FP8_CACHE, EMULATE_BF16)
    tl.store(dst_rows + offs_d[None, :], o1, mask=mask)
    tl.store(dst_rows + HALF + offs_d[None, :], o2, mask=mask)
    if HEAD_DIM > 2 * HALF:  # partial rotary: the tail passes through
        offs_p = 2 * HALF + tl.arange(0, BLOCK_PASS)
        mask_p = mask_h[:, None] & (offs_p[None, :] < HEAD_DIM)
        tail = tl.load(src_rows + offs_p[None, :], mask=mask_p, other=0.0)
        tail = store_value(tail, scale, dst, FP8_CACHE, EMULATE_BF16)  # a copy (quantized for an fp8 cache)
        tl.store(dst_rows + offs_p[None, :], tail, mask=mask_p)


@triton.jit
def _rope_program(
    q_ptr,
    q_out_ptr,
    cos_ptr,
    sin_ptr,
    stride_qt,
    stride_qh,
    stride_qot,
    stride_qoh,
    stride_ct,
    stride_st,
    NUM_Q_HEADS: tl.constexpr,
    Q_BLOCKS: tl.constexpr,
    HALF: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_PASS: tl.constexpr,
    EMULATE_BF16: tl.constexpr,
    PDL: tl.constexpr,
):
    """What both RoPE kernels' program (t, b) does first: wait for its inputs, load token t's cos
    and sin [BLOCK_HALF] in fp32 (zero past HALF) and, for b < Q_BLOCKS, rotate its block of q
    heads. Returns (t, b, cos, sin) for the k programs (b >= Q_BLOCKS)."""
    wait_for_inputs(PDL)
    t = tl.program_id(0).to(tl.int64)
    b = tl.program_id(1)
    offs_d = tl.arange(0, BLOCK_HALF)
    mask_d = offs_d < HALF
    cos = tl.load(cos_ptr + t * stride_ct + offs_d, mask=mask_d, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + t * stride_st + offs_d, mask=mask_d, other=0.0).to(tl.float32)
    if b < Q_BLOCKS:
        _rope_heads(
            q_ptr + t * stride_qt,
            q_out_ptr + t * stride_qot,
            stride_qh,
            stride_qoh,
            b * BLOCK_H,
            NUM_Q_HEADS,
            cos,
            sin,
            HALF,
            HEAD_DIM,
            BLOCK_H,
            BLOCK_HALF,
            BLOCK_PASS,
            EMULATE_BF16,
            1.0,
            False,
        )
    return t, b, cos, sin


@triton.jit
def _rope_kernel(
    q_ptr,
    k_ptr,
    q_out_ptr,
    k_out_ptr,
    cos_ptr,
    sin_ptr,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_qot,
    stride_qoh,
    stride_kot,
    stride_koh,
    stride_ct,
    stride_st,
    NUM_Q_HEADS: tl.constexpr,
    NUM_K_HEADS: tl.constexpr,
    Q_BLOCKS: tl.constexpr,
    HALF: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_PASS: tl.constexpr,
    EMULATE_BF16: tl.constexpr,
    PDL: tl.constexpr,
):
    """Grid (T, Q_BLOCKS + K_BLOCKS): program (t, b) rotates a block of BLOCK_H heads of token t,
    of q for b < Q_BLOCKS, else of k."""
    t, b, cos, sin = _rope_program(
        q_ptr,
        q_out_ptr,
        cos_ptr,
        sin_ptr,
        stride_qt,
        stride_qh,
        stride_qot,
        stride_qoh,
        stride_ct,
        stride_st,
        NUM_Q_HEADS,
        Q_BLOCKS,
        HALF,
        HEAD_DIM,
        BLOCK_H,
        BLOCK_HALF,
        BLOCK_PASS,
        EMULATE_BF16,
        PDL,
    )
    if b >= Q_BLOCKS:
        _rope_heads(
            k_ptr + t * stride_kt,
            k_out_ptr + t * stride_kot,
            stride_kh,
            stride_koh,
            (b - Q_BLOCKS) * BLOCK_H,
            NUM_K_HEADS,
            cos,
            sin,
            HALF,
            HEAD_DIM,
            BLOCK_H,
            BLOCK_HALF,
            BLOCK_PASS,
            EMULATE_BF16,
            1.0,
            False,
        )


def _table_2d(table: torch.Tensor, t: int) -> torch.Tensor | None:
    """cos or sin [T, 1, R/2] (or [T, R/2]) as [T, R/2] with unit last stride, else None."""
    if table.dim() == 3 and table.shape[1] == 1:
        table = table[:, 0]
    if table.dim() != 2 or table.shape[0] != t or table.stride(-1) != 1:
        return None
    return table


def _rope_launch(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor) -> tuple[tuple[int, int], dict[str, int]]:
    """The grid (T, Q_BLOCKS + K_BLOCKS) and the shape constexprs shared by the two RoPE kernels."""
    t, num_q_heads, head_dim = q.shape
    num_k_heads = k.shape[1]
    half = cos.shape[-1]
    block_half = triton.next_power_of_2(half)
    block_h = min(triton.next_power_of_2(max(num_q_heads, num_k_heads)), max(1, _ROPE_TILE // block_half))
    q_blocks = triton.cdiv(num_q_heads, block_h)
    grid = (t, q_blocks + triton.cdiv(num_k_heads, block_h))
    return grid, dict(
        NUM_Q_HEADS=num_q_heads,
        NUM_K_HEADS=num_k_heads,
        Q_BLOCKS=q_blocks,
        HALF=half,
        HEAD_DIM=head_dim,
        BLOCK_H=block_h,
        BLOCK_HALF=block_half,
        BLOCK_PASS=triton.next_power_of_2(max(head_dim - 2 * half, 1)),
    )


def supports_rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    if q.dim() != 3 or k.dim() != 3 or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]:
        return False
    t, _, head_dim = q.shape
    half = cos.shape[-1]
    return (
        q.dtype in DTYPES
        and k.dtype == q.dtype
        and q.stride(2) == 1
        and k.stride(2) == 1
        and cos.dtype in DTYPES
        and sin.dtype == cos.dtype
        and sin.shape == cos.shape
        and 0 < 2 * half <= head_dim
        and q.device == k.device == cos.device == sin.device
        and _table_2d(cos, t) is not None
        and _table_2d(sin, t) is not None
    )


def rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, Hq, D], k [T, Hkv, D] (strided views of a fused projection are fine: only the last dim
    must be contiguous), cos/sin [T, 1, R/2] → new contiguous rotated q, k. The first R dims of each
    head rotate as halves [x1 | x2] → [x1·cos − x2·sin | x2·cos + x1·sin]; dims R..D copy through."""
    assert supports_rotary(q, k, cos, sin), "unsupported rotary arguments"
    t = q.shape[0]
    cos2, sin2 = _table_2d(cos, t), _table_2d(sin, t)
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    if t == 0:
        return q_out, k_out
    grid, shape = _rope_launch(q, k, cos)
    _rope_kernel[grid](
        q,
        k,
        q_out,
        k_out,
        cos2,
        sin2,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        q_out.stride(0),
        q_out.stride(1),
        k_out.stride(0),
        k_out.stride(1),
        cos2.stride(0),
        sin2.stride(0),
        **shape,
        EMULATE_BF16=_interpreting(),
        num_warps=4,
        enable_fp_fusion=False,
        **pdl.launch_args(q),
    )
    return q_out, k_out


@triton.jit
def _rope_store_kv_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    q_out_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    cos_ptr,
    sin_ptr,
    k_scale,
    v_scale,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_qot,
    stride_qoh,
    stride_kcb,
    stride_kcs,
    stride_kch,
    stride_vcb,
    stride_vcs,
    stride_vch,
    stride_ct,
    stride_st,
    NUM_Q_HEADS: tl.constexpr,
    NUM_K_HEADS: tl.constexpr,
    Q_BLOCKS: tl.constexpr,
    HALF: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    CACHE_BLOCK: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_PASS: tl.constexpr,
    BLOCK_D: tl.constexpr,
    FP8_CACHE: tl.constexpr,
    EMULATE_BF16: tl.constexpr,
    PDL: tl.constexpr,
):
    """`_rope_kernel`'s grid, but k programs write their rotated heads, and copy the same heads of v,
    straight into the paged cache at slot_mapping[t] (slot = block * CACHE_BLOCK + offset) instead
    of into a k tensor; a negative slot (a padding token) stores nothing. q programs as before.
    FP8_CACHE: k and v are quantized with k_scale / v_scale as `paged_attention.store_kv` does."""
    t, b, cos, sin = _rope_program(
        q_ptr,
        q_out_ptr,
        cos_ptr,
        sin_ptr,
        stride_qt,
        stride_qh,
        stride_qot,
        stride_qoh,
        stride_ct,
        stride_st,
        NUM_Q_HEADS,
        Q_BLOCKS,
        HALF,
        HEAD_DIM,
        BLOCK_H,
        BLOCK_HALF,
        BLOCK_PASS,
        EMULATE_BF16,
        PDL,
    )
    if b >= Q_BLOCKS:
        slot = tl.load(slot_ptr + t).to(tl.int64)
        if slot >= 0:
            block = slot // CACHE_BLOCK
            offset = slot % CACHE_BLOCK
            head0 = (b - Q_BLOCKS) * BLOCK_H
            _rope_heads(
                k_ptr + t * stride_kt,
                k_cache_ptr + block * stride_kcb + offset * stride_kcs,
                stride_kh,
                stride_kch,
                head0,
                NUM_K_HEADS,
                cos,
                sin,
                HALF,
                HEAD_DIM,
                BLOCK_H,
                BLOCK_HALF,
                BLOCK_PASS,
                EMULATE_BF16,
                k_scale,
                FP8_CACHE,
            )
            offs_h = head0 + tl.arange(0, BLOCK_H)
            offs_d = tl.arange(0, BLOCK_D)
            mask = (offs_h[:, None] < NUM_K_HEADS) & (offs_d[None, :] < HEAD_DIM)
            v = tl.load(v_ptr + t * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
            v_dst = v_cache_ptr + block * stride_vcb + offset * stride_vcs + offs_h[:, None] * stride_vch
            tl.store(v_dst + offs_d[None, :], store_value(v, v_scale, v_cache_ptr, FP8_CACHE, EMULATE_BF16), mask=mask)


def supports_rotary_store_kv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
) -> bool:
    """`supports_rotary`, plus v shaped like k and caches [num_blocks, block_size, Hkv, D] of q's dtype
    or fp8 e4m3, with unit head_dim stride (any layout of the other dims)."""
    return (
        supports_rotary(q, k, cos, sin)
        and v.shape == k.shape
        and v.dtype == k.dtype
        and v.stride(2) == 1
        and k_cache.dim() == 4
        and k_cache.shape == v_cache.shape
        and k_cache.shape[2:] == k.shape[1:]
        and k_cache.dtype == v_cache.dtype
        and k_cache.dtype in (q.dtype, FP8)
        and k_cache.stride(3) == 1
        and v_cache.stride(3) == 1
    )


def rotary_store_kv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """`rotary` and the attention backend's `store_kv` in one launch: returns the rotated q (new,
    contiguous) and writes the rotated k and v [T, Hkv, D] into k_cache/v_cache at slot_mapping [T]
    (negative = skip). The stored values are bit-identical to `rotary` followed by `store_kv` (with
    k_scale / v_scale for an fp8 cache)."""
    assert supports_rotary_store_kv(q, k, v, cos, sin, k_cache, v_cache), "unsupported rotary/cache arguments"
    t = q.shape[0]
    assert slot_mapping.shape == (t,), "slot_mapping must be [T]"
    cos2, sin2 = _table_2d(cos, t), _table_2d(sin, t)
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if t == 0:
        return q_out
    grid, shape = _rope_launch(q, k, cos)
    _rope_store_kv_kernel[grid](
        q,
        k,
        v,
        q_out,
        k_cache,
        v_cache,
        slot_mapping,
        cos2,
        sin2,
        float(k_scale),
        float(v_scale),
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        q_out.stride(0),
        q_out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        cos2.stride(0),
        sin2.stride(0),
        **shape,
        CACHE_BLOCK=k_cache.shape[1],
        BLOCK_D=triton.next_power_of_2(q.shape[2]),
        FP8_CACHE=k_cache.dtype == FP8,
        EMULATE_BF16=_interpreting(),
        num_warps=4,
        enable_fp_fusion=False,
        **pdl.launch_args(q),
    )
    return q_out


# ---------------------------------------------------------------------------------------------
# SiLU-and-mul
# ---------------------------------------------------------------------------------------------


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
    silu = _round_to(tl.math.div_rn(gate, 1.0 + e), out_ptr, EMULATE_BF16)  # F.silu(gate), rounded
    out = silu.to(tl.float32) * up.to(tl.float32)  # * up, rounded again
    return _round_to(out, out_ptr, EMULATE_BF16)


def supports_silu_and_mul(x: torch.Tensor) -> bool:
    return x.dtype in DTYPES and x.dim() >= 1 and x.shape[-1] % 2 == 0 and x.shape[-1] > 0


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [..., 2I] laid out [gate | up] → F.silu(gate) * up [..., I], in x.dtype."""
    assert supports_silu_and_mul(x), "unsupported silu_and_mul arguments"
    n_cols = x.shape[-1] // 2
    x2 = _rows(x)
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
        PRECISE_EXP=not _interpreting(),
        EMULATE_BF16=_interpreting(),
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
    t = _round_to(x * 1.702, out_ptr, EMULATE_BF16).to(tl.float32)
    if PRECISE_EXP:
        e = libdevice.exp(-t)  # expf, as PyTorch's CUDA sigmoid
    else:  # the interpreter: see silu_mul
        e = tl.exp(-t.to(tl.float64)).to(tl.float32)
    sig = _round_to(tl.math.div_rn(1.0, 1.0 + e), out_ptr, EMULATE_BF16).to(tl.float32)
    tl.store(out_ptr + offs, _round_to(x * sig, out_ptr, EMULATE_BF16), mask=mask)


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
        PRECISE_EXP=not _interpreting(),
        EMULATE_BF16=_interpreting(),
        num_warps=4,
        enable_fp_fusion=False,
    )
    return out


# ---------------------------------------------------------------------------------------------
# Yuan2's LF gate on one-token rows: the state shifts fused into the norms around its two GEMMs
# ---------------------------------------------------------------------------------------------


@triton.jit
def _lf_decode_in_kernel(
    h_ptr,
    residual_ptr,
    weight_ptr,
    summed_ptr,
    bias_ptr,
    state_ptr,
    slots_ptr,
    snap_ptr,
    snapshots_ptr,
    in1_ptr,
    in2_ptr,
    stride_h,
    stride_r,
    stride_s,
    stride_state,
    stride_snap,
    stride_in1,
    stride_in2,
    eps,
    H: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    HAS_SNAPSHOT: tl.constexpr,
    EMULATE_BF16: tl.constexpr,
    PDL: tl.constexpr,
):
    """One program per row b (sequence in state slot s):
    x = input_layernorm(h [+ residual]) (the sum stored to summed), then
    in1[b] = [state[s, :H] | x], in2[b] = [state[s, H:] | conv1 bias], state[s, :H] = x
    (and the snapshot's). in2's right half is where conv1's GEMM accumulates o1."""
    wait_for_inputs(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < H
    x = tl.load(h_ptr + row * stride_h + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + offs, mask=mask, other=0.0)
        x = _round_to(x.to(tl.float32) + r.to(tl.float32), h_ptr, EMULATE_BF16)
        tl.store(summed_ptr + row * stride_s + offs, x, mask=mask)
    x = _rms_weighted(x, weight_ptr, offs, mask, eps, H, in1_ptr, EMULATE_BF16)
    slot = tl.load(slots_ptr + row).to(tl.int64)
    offs_half = tl.arange(0, BLOCK_HALF)
    mask_half = offs_half < HALF
    saved = state_ptr + slot * stride_state
    x_prev = tl.load(saved + offs, mask=mask, other=0.0)
    o1_prev = tl.load(saved + H + offs_half, mask=mask_half, other=0.0)
    tl.store(in1_ptr + row * stride_in1 + offs, x_prev, mask=mask)
    tl.store(in1_ptr + row * stride_in1 + H + offs, x, mask=mask)
    tl.store(in2_ptr + row * stride_in2 + offs_half, o1_prev, mask=mask_half)
    tl.store(
        in2_ptr + row * stride_in2 + HALF + offs_half, tl.load(bias_ptr + offs_half, mask=mask_half), mask=mask_half
    )
    tl.debug_barrier()  # every lane has read the old state before any lane overwrites it
    tl.store(saved + offs, x, mask=mask)
    if HAS_SNAPSHOT:
        snap = tl.load(snap_ptr + row).to(tl.int64)
        tl.store(snapshots_ptr + snap * stride_snap + offs, x, mask=mask)


@triton.jit
def _lf_decode_out_kernel(
    o2_ptr,
    x_ptr,
    weight_ptr,
    out_ptr,
    o1_ptr,
    state_ptr,
    slots_ptr,
    snap_ptr,
    snapshots_ptr,
    stride_o2,
    stride_x,
    stride_out,
    stride_o1,
    stride_state,
    stride_snap,
    eps,
    H: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    HAS_SNAPSHOT: tl.constexpr,
    EMULATE_BF16: tl.constexpr,
    PDL: tl.constexpr,
):
    """One program per row b: out[b] = output_layernorm(o2[b] + x[b]); state[s, H:] = o1[b]
    (and the snapshot's)."""
    wait_for_inputs(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < H
    o2 = tl.load(o2_ptr + row * stride_o2 + offs, mask=mask, other=0.0)
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    summed = _round_to(o2.to(tl.float32) + x.to(tl.float32), o2_ptr, EMULATE_BF16)
    tl.store(
        out_ptr + row * stride_out + offs,
        _rms_weighted(summed, weight_ptr, offs, mask, eps, H, out_ptr, EMULATE_BF16),
        mask=mask,
    )
    offs_half = tl.arange(0, BLOCK_HALF)
    mask_half = offs_half < HALF
    o1 = tl.load(o1_ptr + row * stride_o1 + offs_half, mask=mask_half, other=0.0)
    slot = tl.load(slots_ptr + row).to(tl.int64)
    tl.store(state_ptr + slot * stride_state + H + offs_half, o1, mask=mask_half)
    if HAS_SNAPSHOT:
        snap = tl.load(snap_ptr + row).to(tl.int64)
        tl.store(snapshots_ptr + snap * stride_snap + H + offs_half, o1, mask=mask_half)


def supports_lf_decode(h: torch.Tensor, norm_weight: torch.Tensor, state: torch.Tensor) -> bool:
    """h [B, H] one token per row; state [S, 1.5·H] = [x_prev | o1_prev] per slot."""
    hidden = h.shape[-1] if h.dim() == 2 else 0
    return (
        h.dim() == 2
        and h.dtype in DTYPES
        and h.stride(1) == 1
        and hidden % 2 == 0
        and 0 < hidden <= MAX_NORM_SIZE
        and norm_weight.dtype == h.dtype
        and norm_weight.shape == (hidden,)
        and state.dim() == 2
        and state.dtype == h.dtype
        and state.stride(1) == 1
        and state.shape[1] == hidden + hidden // 2
        and state.device == h.device == norm_weight.device
    )


def _snapshot_args(
    snapshot_index: torch.Tensor | None, snapshots: torch.Tensor | None, state: torch.Tensor, slots: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, int]:
    if snapshot_index is None:
        return slots, state, 0  # placeholders, never read (HAS_SNAPSHOT false)
    assert snapshots is not None and snapshots.stride(1) == 1 and snapshots.shape[1] == state.shape[1]
    return snapshot_index, snapshots, snapshots.stride(0)


def lf_decode_input(
    h: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    conv1_bias: torch.Tensor,
    state: torch.Tensor,
    slots: torch.Tensor,
    snapshot_index: torch.Tensor | None = None,
    snapshots: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The decoder layer's input norm and the LF gate's input shifts in one launch, for one-token rows.

    h [B, H] (+ residual [B, H]: the norm sees round(h + residual), which is returned as the new
    residual stream; without it h is the stream). Returns (in1 [B, 2H], in2 [B, H], residual) with
    x = input_layernorm(...) = in1[:, H:]:
      in1 = [x_prev | x]            conv1's input (x_prev = state[slots, :H])
      in2 = [o1_prev | conv1 bias]  conv2's input once conv1 has accumulated into in2[:, H/2:]
    and writes state[slots, :H] = x (and snapshots[snapshot_index, :H]). The reference is the layer's
    unfused path: `input_layernorm`, then `index_select` / `cat` / `index_copy_` on the state."""
    assert supports_lf_decode(h, norm_weight, state), "unsupported lf_decode_input arguments"
    rows, hidden = h.shape
    half = hidden // 2
    assert conv1_bias.shape == (half,) and conv1_bias.dtype == h.dtype and conv1_bias.is_contiguous()
    if residual is not None:
        assert residual.shape == h.shape and residual.dtype == h.dtype and residual.stride(1) == 1
    in1 = torch.empty(rows, 2 * hidden, dtype=h.dtype, device=h.device)
    in2 = torch.empty(rows, hidden, dtype=h.dtype, device=h.device)
    summed = torch.empty_like(h) if residual is not None else h
    if rows:
        snap_index, snaps, stride_snap = _snapshot_args(snapshot_index, snapshots, state, slots)
        block = triton.next_power_of_2(hidden)
        r = residual if residual is not None else h
        _lf_decode_in_kernel[(rows,)](
            h,
            r,
            norm_weight,
            summed,
            conv1_bias,
            state,
            slots,
            snap_index,
            snaps,
            in1,
            in2,
            h.stride(0),
            r.stride(0),
            summed.stride(0),
            state.stride(0),
            stride_snap,
            in1.stride(0),
            in2.stride(0),
            float(eps),
            H=hidden,
            HALF=half,
            BLOCK=block,
            BLOCK_HALF=triton.next_power_of_2(half),
            HAS_RESIDUAL=residual is not None,
            HAS_SNAPSHOT=snapshot_index is not None,
            EMULATE_BF16=_interpreting(),
            num_warps=min(max(block // 512, 1), 16),
            enable_fp_fusion=False,
            **pdl.launch_args(h),
        )
    return in1, in2, summed


def lf_decode_output(
    o2: torch.Tensor,
    x: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    o1: torch.Tensor,
    state: torch.Tensor,
    slots: torch.Tensor,
    snapshot_index: torch.Tensor | None = None,
    snapshots: torch.Tensor | None = None,
) -> torch.Tensor:
    """The LF gate's output norm, output_layernorm(o2 + x) [B, H], with the state update
    state[slots, H:] = o1 [B, H/2] (and snapshots[snapshot_index, H:]) in the same launch.
    x and o1 may be strided row views (unit stride along features)."""
    assert supports_lf_decode(o2, norm_weight, state), "unsupported lf_decode_output arguments"
    rows, hidden = o2.shape
    half = hidden // 2
    assert x.shape == o2.shape and x.stride(1) == 1 and o1.shape == (rows, half) and o1.stride(1) == 1
    out = torch.empty_like(o2)
    if rows:
        snap_index, snaps, stride_snap = _snapshot_args(snapshot_index, snapshots, state, slots)
        block = triton.next_power_of_2(hidden)
        _lf_decode_out_kernel[(rows,)](
            o2,
            x,
            norm_weight,
            out,
            o1,
            state,
            slots,
            snap_index,
            snaps,
            o2.stride(0),
            x.stride(0),
            out.stride(0),
            o1.stride(0),
            state.stride(0),
            stride_snap,
            float(eps),
            H=hidden,
            HALF=half,
            BLOCK=block,
            BLOCK_HALF=triton.next_power_of_2(half),
            HAS_SNAPSHOT=snapshot_index is not None,
            EMULATE_BF16=_interpreting(),
            num_warps=min(max(block // 512, 1), 16),
            enable_fp_fusion=False,
            **pdl.launch_args(o2),
        )
    return out
