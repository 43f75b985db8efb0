"""Store new K/V rows into the paged cache, and what the cache holds.

Cache layout (see `pagoda/layers/attention.py`): K and V are [num_blocks, block_size, Hkv, D];
position p of a request lives at block `block_table[p // block_size]`, offset `p % block_size`.
Block 0 is the null block that pads block tables. The attention kernels read only positions <
seq_len: a key tile that may run past it is loaded with a mask (never "load, then multiply by
zero"), so unwritten slots, even NaN garbage, cannot leak into the output.

FP8 cache (`--kv-cache-dtype fp8`): the caches hold e4m3 (`torch.float8_e4m3fn`) with one scale per
tensor per layer, k_scale and v_scale (plain floats, fixed after loading, so a captured CUDA graph
may bake them in). The store writes q = e4m3(clamp(x / scale, ±448)) (fp32 division, round to
nearest even: `torch`'s own `.to(torch.float8_e4m3fn)` of the same fp32 value); a read means
x = float(q) * scale. The attention kernels widen each e4m3 tile exactly to q's dtype (e4m3 ⊂ fp16,
bf16, fp32) and fold the scales into fp32 arithmetic instead of scaling every element: k_scale into
the score scale (s = (q · k) * scale * k_scale, the dot accumulated in fp32), v_scale into the fp32
output accumulator. That is the dequantized attention up to fp32 rounding. With a cache of the
model's dtype the scales are ignored.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagoda.kernels import pdl
from pagoda.kernels.pdl import wait_for_inputs
from pagoda.kernels.triton_utils import interpreting

FP8 = torch.float8_e4m3fn  # the fp8 cache's element type (Triton's float8e4nv)
FP8_MAX = tl.constexpr(448.0)  # largest finite e4m3 value: stores saturate here (e4m3fn has no inf)


def is_fp8(cache: torch.Tensor) -> bool:
    return cache.dtype == FP8


@triton.jit
def _round_to_e4m3(x):
    """fp32 x (|x| <= 448) rounded to the nearest e4m3 value, ties to even, kept in fp32.

    For the interpreter only: Triton 3.6's interpreter converts fp32 → e4m3 by truncating the
    subnormals and drops the carry of a rounding that reaches the next power of two (31.5 → 16), so
    the value is put on the e4m3 grid here and the cast that follows is exact. Normals (|x| >= 2^-6)
    keep 3 mantissa bits (round the 20 dropped bits to nearest even on the integer bits); subnormals
    are multiples of 2^-9, which adding and subtracting 1.5 * 2^14 rounds to (fp32 ulp there: 2^-9).
    Both on |x|; the sign bit is put back last (so -tiny → -0, as the hardware and torch give)."""
    bits = x.to(tl.uint32, bitcast=True)
    sign = bits & 0x80000000
    magnitude = bits & 0x7FFFFFFF
    a = magnitude.to(tl.float32, bitcast=True)
    normal = ((magnitude + 0x7FFFF + ((magnitude >> 20) & 1)) >> 20) << 20
    subnormal = ((a + 24576.0) - 24576.0).to(tl.uint32, bitcast=True)
    return (tl.where(a < 0.015625, subnormal, normal) | sign).to(tl.float32, bitcast=True)


@triton.jit
def store_value(x, scale, dst_ptr, FP8_CACHE: tl.constexpr, EMULATE: tl.constexpr):
    """x as a cache of dst_ptr's type stores it: unchanged, or (FP8_CACHE) e4m3(clamp(x / scale, ±448))
    with the division in fp32. EMULATE: the interpreter's fp8 rounding fix (`_round_to_e4m3`).
    `div_rn`, not `/`: Triton lowers an fp32 `/` to PTX's approximate `div.full.f32` (up to 2 ulp), and a
    quotient one ulp off flips the e4m3 rounding of a value near a tie, so the store would not be torch's."""
    if FP8_CACHE:
        y = tl.clamp(tl.math.div_rn(x.to(tl.float32), scale), -FP8_MAX, FP8_MAX)
        if EMULATE:
            y = _round_to_e4m3(y)
        return y.to(dst_ptr.dtype.element_ty)
    else:
        return x


@triton.jit
def _store_kv_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    k_scale,
    v_scale,
    k_strides,  # k.stride(): (token, head, dim)
    v_strides,
    kc_strides,  # k_cache.stride(): (block, slot, head, dim)
    vc_strides,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    FP8_CACHE: tl.constexpr,
    EMULATE_FP8: tl.constexpr,
    PDL: tl.constexpr,
):
    """One program per token: copy its [Hkv, D] K and V rows into cache slot slot_mapping[t]
    (quantized with k_scale / v_scale into an fp8 cache). A negative slot (a padding token) writes
    nothing."""
    wait_for_inputs(PDL)
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < NUM_KV_HEADS) & (offs_d[None, :] < HEAD_DIM) & (slot >= 0)  # [BLOCK_H, BLOCK_D]
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    k = tl.load(k_ptr + t * k_strides[0] + offs_h[:, None] * k_strides[1] + offs_d[None, :], mask=mask)
    v = tl.load(v_ptr + t * v_strides[0] + offs_h[:, None] * v_strides[1] + offs_d[None, :], mask=mask)
    k_dst = k_cache_ptr + block * kc_strides[0] + offset * kc_strides[1] + offs_h[:, None] * kc_strides[2]
    v_dst = v_cache_ptr + block * vc_strides[0] + offset * vc_strides[1] + offs_h[:, None] * vc_strides[2]
    k_dst += offs_d[None, :]
    v_dst += offs_d[None, :]
    tl.store(k_dst, store_value(k, k_scale, k_cache_ptr, FP8_CACHE, EMULATE_FP8), mask=mask)
    tl.store(v_dst, store_value(v, v_scale, v_cache_ptr, FP8_CACHE, EMULATE_FP8), mask=mask)


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """k/v [T, Hkv, D] → k_cache/v_cache [num_blocks, block_size, Hkv, D] at slot_mapping [T]
    (slot = block * block_size + offset; negative = skip). An fp8 cache stores what
    `pagoda.layers.attention.quantize_kv(k, k_scale)` gives (v with v_scale), bit for bit; other
    caches ignore the scales."""
    t, num_kv_heads, head_dim = k.shape
    check_cache(k_cache, v_cache, num_kv_heads, head_dim, k.dtype)
    assert v.shape == k.shape and v.dtype == k.dtype, "k and v must match"
    assert k.stride(2) == 1 and v.stride(2) == 1, "k/v head_dim must be contiguous"
    assert slot_mapping.shape == (t,), "slot_mapping must be [T]"
    if t == 0:
        return
    _store_kv_kernel[(t,)](
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        float(k_scale),
        float(v_scale),
        k.stride(),
        v.stride(),
        k_cache.stride(),
        v_cache.stride(),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=k_cache.shape[1],
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
        FP8_CACHE=is_fp8(k_cache),
        EMULATE_FP8=interpreting(),
        **pdl.launch_args(k),
    )


def check_cache(
    k_cache: torch.Tensor, v_cache: torch.Tensor, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> None:
    assert k_cache.dim() == 4 and k_cache.shape == v_cache.shape, "caches must be [num_blocks, block_size, Hkv, D]"
    assert k_cache.shape[2:] == (num_kv_heads, head_dim), (
        f"cache heads/dim {tuple(k_cache.shape[2:])} != {(num_kv_heads, head_dim)}"
    )
    assert k_cache.dtype == v_cache.dtype and k_cache.dtype in (dtype, FP8), (
        f"cache dtype {k_cache.dtype} is neither {dtype} nor {FP8}"
    )
    assert k_cache.stride(3) == 1 and v_cache.stride(3) == 1, "cache head_dim must be contiguous"
    assert head_dim >= 1 and k_cache.shape[1] >= 1
