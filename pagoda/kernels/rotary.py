"""Neox-style (rotate-half) RoPE for q and k in one Triton launch, and the same with k and v written
straight into the paged KV cache (`rotary_store_kv`).

References: `rotary` is `pagoda.layers.rotary.apply_rotary_reference(q, k, (cos, sin))`;
`rotary_store_kv` is `rotary`, then `attention.store_kv.store_kv` (the Triton backend's KV store; fp8
caches too). Bit-identical: `x1 * cos - x2 * sin` as three rounded fp32 operations, like PyTorch's
eager ops — the kernels are launched with `enable_fp_fusion=False`, so no multiply-add is contracted
into an FMA.

Launchers check shapes/dtypes/strides and launch; they never read device values on the host. Kernels
may not import layers.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagoda.kernels import pdl
from pagoda.kernels.attention.store_kv import FP8, store_value
from pagoda.kernels.pdl import wait_for_inputs
from pagoda.kernels.triton_utils import DTYPES, interpreting, round_to

_ROPE_TILE = 1024  # elements of one RoPE program's [heads, R/2] tile (caps heads per program)


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
    o1 = store_value(round_to(o1, src, EMULATE_BF16), scale, dst, FP8_CACHE, EMULATE_BF16)
    o2 = store_value(round_to(o2, src, EMULATE_BF16), scale, dst, FP8_CACHE, EMULATE_BF16)
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
    q_strides,  # q.stride(): (token, head, dim)
    qo_strides,  # q_out.stride()
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
            q_ptr + t * q_strides[0],
            q_out_ptr + t * qo_strides[0],
            q_strides[1],
            qo_strides[1],
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
    q_strides,  # q.stride(): (token, head, dim)
    k_strides,
    qo_strides,  # q_out.stride()
    ko_strides,
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
        q_strides,
        qo_strides,
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
            k_ptr + t * k_strides[0],
            k_out_ptr + t * ko_strides[0],
            k_strides[1],
            ko_strides[1],
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
        q.stride(),
        k.stride(),
        q_out.stride(),
        k_out.stride(),
        cos2.stride(0),
        sin2.stride(0),
        **shape,
        EMULATE_BF16=interpreting(),
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
    q_strides,  # q.stride(): (token, head, dim)
    k_strides,
    v_strides,
    qo_strides,  # q_out.stride()
    kc_strides,  # k_cache.stride(): (block, slot, head, dim)
    vc_strides,
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
        q_strides,
        qo_strides,
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
                k_ptr + t * k_strides[0],
                k_cache_ptr + block * kc_strides[0] + offset * kc_strides[1],
                k_strides[1],
                kc_strides[2],
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
            v = tl.load(v_ptr + t * v_strides[0] + offs_h[:, None] * v_strides[1] + offs_d[None, :], mask=mask)
            v_dst = v_cache_ptr + block * vc_strides[0] + offset * vc_strides[1] + offs_h[:, None] * vc_strides[2]
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
        q.stride(),
        k.stride(),
        v.stride(),
        q_out.stride(),
        k_cache.stride(),
        v_cache.stride(),
        cos2.stride(0),
        sin2.stride(0),
        **shape,
        CACHE_BLOCK=k_cache.shape[1],
        BLOCK_D=triton.next_power_of_2(q.shape[2]),
        FP8_CACHE=k_cache.dtype == FP8,
        EMULATE_BF16=interpreting(),
        num_warps=4,
        enable_fp_fusion=False,
        **pdl.launch_args(q),
    )
    return q_out
