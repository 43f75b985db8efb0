"""Paged attention in Triton: store K/V into the paged cache, decode attention (split-K "flash
decoding"), and variable-length causal prefill attention over the paged cache.

Cache layout (see `pagoda/layers/attention.py`): K and V are [num_blocks, block_size, Hkv, D];
position p of a request lives at block `block_table[p // block_size]`, offset `p % block_size`.
Block 0 is the null block that pads block tables. Kernels read only positions < seq_len: a key tile
that may run past it is loaded with a mask (never "load, then multiply by zero"), so unwritten
slots, even NaN garbage, cannot leak into the output.

All softmax arithmetic is fp32 in the log2 domain (fp32 scores are multiplied by scale * log2(e),
then `exp2`), with the running max started at a large finite negative value rather than -inf so a
row that has seen no key yet never computes `-inf - -inf = NaN`.

FP8 cache (`--kv-cache-dtype fp8`): the caches hold e4m3 (`torch.float8_e4m3fn`) with one scale per
tensor per layer, k_scale and v_scale (plain floats, fixed after loading, so a captured CUDA graph
may bake them in). The store writes q = e4m3(clamp(x / scale, ±448)) (fp32 division, round to
nearest even: `torch`'s own `.to(torch.float8_e4m3fn)` of the same fp32 value); a read means
x = float(q) * scale. The attention kernels widen each e4m3 tile exactly to q's dtype (e4m3 ⊂ fp16,
bf16, fp32) and fold the scales into fp32 arithmetic instead of scaling every element: k_scale into
the score scale (s = (q · k) * scale * k_scale, the dot accumulated in fp32), v_scale into the fp32
output accumulator. That is the dequantized attention up to fp32 rounding. With a cache of the
model's dtype the scales are ignored.

The launchers check shapes and strides, pick block sizes, and launch. They never read device values
on the host except where documented (`num_splits=None`, `tiles=None`), so the backend can keep its
per-layer path free of host-device syncs. The PyTorch reference for these kernels is
`pagoda.layers.torch_attention.TorchAttentionBackend` (plus the dense per-request attention in
`tests/kernels/test_paged_attention.py`); kernels may not import layers.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import triton
import triton.language as tl

from pagoda import envs
from pagoda.kernels import dispatch, pdl
from pagoda.kernels.pdl import wait_for_inputs

_LOG2E = 1.4426950408889634
_NEG_BIG = tl.constexpr(-1.0e30)  # running-max start: finite, so exp2(m_old - m_new) is never NaN

# Split-K rule (decode): aim for ~2 programs per SM, but never give a split fewer than this many keys
# (below that the partial write + merge cost more than the parallelism buys) nor more splits than this.
MIN_KEYS_PER_SPLIT = 256
MAX_SPLITS = 64

FP8 = torch.float8_e4m3fn  # the fp8 cache's element type (Triton's float8e4nv)
FP8_MAX = tl.constexpr(448.0)  # largest finite e4m3 value: stores saturate here (e4m3fn has no inf)


def _interpreting() -> bool:
    return envs.TRITON_INTERPRET.value


def _dot_flags(dtype: torch.dtype) -> tuple[bool, bool]:
    """(IEEE, UPCAST) constexprs for `_mma`.

    IEEE: fp32 inputs use exact fp32 products, not TF32 (which would be ~1e-3 off the reference).
    UPCAST: Triton 3.6's interpreter computes bf16 `tl.dot` wrong (it treats the raw bits as
    integers), so under the interpreter bf16 operands are widened to fp32 first. bf16 products are
    exact in fp32 and MMA accumulates in fp32, so this matches the GPU's numerics."""
    return dtype == torch.float32, dtype == torch.bfloat16 and _interpreting()


@triton.jit
def _mma(a, b, IEEE: tl.constexpr, UPCAST: tl.constexpr):
    """a [M, K] @ b [K, N] → fp32 [M, N]."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    elif IEEE:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b)


# ---------------------------------------------------------------------------------------------
# FP8 quantization of stored values
# ---------------------------------------------------------------------------------------------


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
    with the division in fp32. EMULATE: the interpreter's fp8 rounding fix (`_round_to_e4m3`)."""
    if FP8_CACHE:
        y = tl.clamp(x.to(tl.float32) / scale, -FP8_MAX, FP8_MAX)
        if EMULATE:
            y = _round_to_e4m3(y)
        return y.to(dst_ptr.dtype.element_ty)
    else:
        return x


# ---------------------------------------------------------------------------------------------
# store_kv
# ---------------------------------------------------------------------------------------------


@triton.jit
def _store_kv_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    k_scale,
    v_scale,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kcb,
    stride_kcs,
    stride_kch,
    stride_vcb,
    stride_vcs,
    stride_vch,
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
    k = tl.load(k_ptr + t * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
    v = tl.load(v_ptr + t * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
    k_dst = k_cache_ptr + block * stride_kcb + offset * stride_kcs + offs_h[:, None] * stride_kch + offs_d[None, :]
    v_dst = v_cache_ptr + block * stride_vcb + offset * stride_vcs + offs_h[:, None] * stride_vch + offs_d[None, :]
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
    _check_cache(k_cache, v_cache, num_kv_heads, head_dim, k.dtype)
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
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=k_cache.shape[1],
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
        FP8_CACHE=is_fp8(k_cache),
        EMULATE_FP8=_interpreting(),
        **pdl.launch_args(k),
    )


# ---------------------------------------------------------------------------------------------
# Shared inner step: one tile of keys for a block of query rows
# ---------------------------------------------------------------------------------------------


@triton.jit
def _load_kv_rows(ptr, row_off, offs_d, mask_n, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, MASK_KEYS: tl.constexpr):
    """Rows ptr + row_off[n] (+ d) → [BLOCK_N, BLOCK_D]; masked only where a key or a padded head-dim
    lane may be invalid, so the common (full tile, power-of-two D) case is an unmasked load."""
    ptrs = ptr + row_off[:, None] + offs_d[None, :]
    if MASK_KEYS:
        return tl.load(ptrs, mask=mask_n[:, None] & (offs_d[None, :] < HEAD_DIM), other=0.0)
    elif HEAD_DIM != BLOCK_D:
        return tl.load(ptrs, mask=offs_d[None, :] < HEAD_DIM, other=0.0)
    else:
        return tl.load(ptrs)


@triton.jit
def _attend_tile(
    q,
    m_i,
    l_i,
    acc,
    qk_scale,
    k_cache_ptr,
    v_cache_ptr,
    table_row_ptr,
    kv_head,
    n0,
    key_end,
    q_pos,
    stride_kcb,
    stride_kcs,
    stride_kch,
    stride_vcb,
    stride_vcs,
    stride_vch,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    MASK_KEYS: tl.constexpr,
    CAUSAL: tl.constexpr,
    KV_FP8: tl.constexpr,
    IEEE: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """Fold keys [n0, n0 + BLOCK_N) into the online softmax of the query rows q [M, BLOCK_D].

    m_i [M] running max (log2 domain), l_i [M] running sum, acc [M, BLOCK_D] unnormalised output,
    all fp32. Each key's slot is looked up through the block table, so BLOCK_N need not relate to
    block_size (a tile may span several cache blocks, or part of one).
    MASK_KEYS: keys >= key_end may be in this tile (masked loads, -inf scores).
    CAUSAL: row r sees only keys <= q_pos[r] (implies MASK_KEYS; q_pos is unused otherwise).
    KV_FP8: the tiles are e4m3, widened exactly to q's dtype; their scales are the caller's (k_scale
    inside qk_scale, v_scale on the final acc)."""
    offs_n = n0 + tl.arange(0, BLOCK_N)  # [BLOCK_N] key positions
    offs_d = tl.arange(0, BLOCK_D)
    mask_n = offs_n < key_end
    if MASK_KEYS:
        block = tl.load(table_row_ptr + offs_n // BLOCK_SIZE, mask=mask_n, other=0).to(tl.int64)
    else:
        block = tl.load(table_row_ptr + offs_n // BLOCK_SIZE).to(tl.int64)
    within = offs_n % BLOCK_SIZE
    k_off = block * stride_kcb + within * stride_kcs + kv_head * stride_kch  # [BLOCK_N] int64
    k = _load_kv_rows(k_cache_ptr, k_off, offs_d, mask_n, HEAD_DIM, BLOCK_D, MASK_KEYS)  # [BLOCK_N, BLOCK_D]
    if KV_FP8:
        k = k.to(q.dtype)
    s = _mma(q, tl.trans(k), IEEE, UPCAST) * qk_scale  # [M, BLOCK_N] log2 domain
    if CAUSAL:
        s = tl.where((offs_n[None, :] <= q_pos[:, None]) & mask_n[None, :], s, float("-inf"))
    elif MASK_KEYS:
        s = tl.where(mask_n[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])  # [M, BLOCK_N]
    l_i = l_i * alpha + tl.sum(p, 1)
    v_off = block * stride_vcb + within * stride_vcs + kv_head * stride_vch
    v = _load_kv_rows(v_cache_ptr, v_off, offs_d, mask_n, HEAD_DIM, BLOCK_D, MASK_KEYS)  # [BLOCK_N, BLOCK_D]
    if KV_FP8:
        v = v.to(q.dtype)
    acc = acc * alpha[:, None] + _mma(p.to(v.dtype), v, IEEE, UPCAST)
    return m_new, l_i, acc


# ---------------------------------------------------------------------------------------------
# Decode: one query token per row; all query heads of a KV head in one program
# ---------------------------------------------------------------------------------------------


@triton.jit(do_not_specialize=["stride_table", "num_splits"])
def _decode_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    tables_ptr,
    seq_lens_ptr,
    qidx_ptr,
    out_ptr,
    part_acc_ptr,
    part_m_ptr,
    part_l_ptr,
    counter_ptr,
    qk_scale,
    v_scale,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_table,
    stride_kcb,
    stride_kcs,
    stride_kch,
    stride_vcb,
    stride_vcs,
    stride_vch,
    num_splits,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,
    SPLIT: tl.constexpr,
    HAS_QIDX: tl.constexpr,
    KV_FP8: tl.constexpr,
    IEEE: tl.constexpr,
    UPCAST: tl.constexpr,
    PDL: tl.constexpr,
):
    """Program (row, kv_head, split): the GROUP query heads sharing kv_head attend to this split's
    share of the row's keys, so each K/V tile is read once for the whole group.

    Splits divide the row's key tiles evenly (computed here from seq_len, so num_splits is the only
    host-side choice); trailing splits of a short row may be empty. Without SPLIT (num_splits == 1)
    the normalised output is written directly; otherwise the unnormalised acc [GROUP, D], max and sum
    go to the partial buffers [rows, Hq, num_splits(, D)], and the split that finishes last for its
    (row, kv_head) merges them (`_merge_splits`): no second kernel, whose launch and drain cost a
    batch-1 step more than the merge itself. counter_ptr [rows, Hkv] int32 counts finished splits;
    it must be zero at launch and the merging split sets it back to zero.

    num_splits and stride_table (the block-table width, which changes from step to step in eager
    steps) are plain runtime integers, not specialised: otherwise each new value, or a width that
    happens to be divisible by 16, would JIT-compile a fresh kernel in the middle of serving."""
    wait_for_inputs(PDL)
    row = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + row)
    if HAS_QIDX:
        token = tl.load(qidx_ptr + row).to(tl.int64)
    else:
        token = row.to(tl.int64)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    heads = kv_head * GROUP + offs_g  # [BLOCK_G]
    mask_q = (offs_g[:, None] < GROUP) & (offs_d[None, :] < HEAD_DIM)  # [BLOCK_G, BLOCK_D]
    q = tl.load(q_ptr + token * stride_qt + heads[:, None] * stride_qh + offs_d[None, :], mask=mask_q, other=0.0)

    tiles_per_split = tl.cdiv(tl.cdiv(seq_len, BLOCK_N), num_splits)
    start = split * tiles_per_split * BLOCK_N
    end = tl.minimum(start + tiles_per_split * BLOCK_N, seq_len)
    m_i = tl.full([BLOCK_G], _NEG_BIG, tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    table_row = tables_ptr + row.to(tl.int64) * stride_table
    for n0 in range(start, end, BLOCK_N):
        m_i, l_i, acc = _attend_tile(
            q,
            m_i,
            l_i,
            acc,
            qk_scale,
            k_cache_ptr,
            v_cache_ptr,
            table_row,
            kv_head,
            n0,
            end,
            0,
            stride_kcb,
            stride_kcs,
            stride_kch,
            stride_vcb,
            stride_vcs,
            stride_vch,
            HEAD_DIM,
            BLOCK_SIZE,
            BLOCK_N,
            BLOCK_D,
            True,
            False,
            KV_FP8,
            IEEE,
            UPCAST,
        )
    if KV_FP8:
        acc = acc * v_scale  # dequantize V once, on the (linear) accumulator

    if not SPLIT:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # seq_len 0 (a padding row) → zeros
        tl.store(
            out_ptr + token * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=mask_q,
        )
    else:
        part = (row * NUM_HEADS + heads).to(tl.int64) * num_splits + split  # [BLOCK_G] into [rows, Hq, S]
        tl.store(part_m_ptr + part, m_i, mask=offs_g < GROUP)
        tl.store(part_l_ptr + part, l_i, mask=offs_g < GROUP)
        tl.store(part_acc_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=mask_q)
        # Release: every thread's partial stores happen before the (one-thread) gpu-scope atomic, so
        # the split that counts last sees all partials of its (row, kv_head) (the CUTLASS semaphore
        # pattern: CTA barrier, then a release by one thread; the reader acquires, then barriers).
        tl.debug_barrier()
        counter = counter_ptr + row * NUM_KV_HEADS + kv_head
        finished = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
        if finished == num_splits - 1:
            tl.debug_barrier()
            tl.store(counter, 0)  # ready for the next launch (which waits for this one)
            _merge_splits(
                part_acc_ptr,
                part_m_ptr,
                part_l_ptr,
                out_ptr + token * stride_ot,
                stride_oh,
                (row * NUM_HEADS + kv_head * GROUP).to(tl.int64) * num_splits,
                kv_head * GROUP,
                num_splits,
                GROUP,
                HEAD_DIM,
                BLOCK_S,
                BLOCK_D,
            )


@triton.jit
def _merge_splits(
    part_acc_ptr,
    part_m_ptr,
    part_l_ptr,
    out_row_ptr,
    stride_oh,
    base,
    head0,
    num_splits,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Heads head0 .. head0 + GROUP - 1 of one row: out = Σ w_s acc_s / Σ w_s l_s over the splits, with
    w_s = 2^(m_s - max_s m_s); head g's partials start at base + g * num_splits. Empty splits carry
    m = -1e30, l = 0, acc = 0 and get weight 0 (a row with no keys at all gets zeros). Loads bypass
    L1 (.cg): the partials were written by other SMs."""
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    mask_s = offs_s < num_splits
    mask = mask_s[:, None] & (offs_d[None, :] < HEAD_DIM)
    for g in tl.static_range(GROUP):
        part = base + g * num_splits + offs_s  # [BLOCK_S]
        m = tl.load(part_m_ptr + part, mask=mask_s, other=float("-inf"), cache_modifier=".cg")
        l_s = tl.load(part_l_ptr + part, mask=mask_s, other=0.0, cache_modifier=".cg")
        w = tl.exp2(m - tl.max(m, 0))
        acc = tl.load(
            part_acc_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], mask=mask, other=0.0, cache_modifier=".cg"
        )
        denom = tl.sum(w * l_s, 0)
        out = tl.sum(acc * w[:, None], 0) / tl.where(denom > 0, denom, 1.0)  # [BLOCK_D]
        tl.store(
            out_row_ptr + (head0 + g) * stride_oh + offs_d, out.to(out_row_ptr.dtype.element_ty), mask=offs_d < HEAD_DIM
        )


def choose_num_splits(num_rows: int, num_kv_heads: int, max_seq_len: int, num_sms: int) -> int:
    """Split-K count for decode: enough (row, kv head, split) programs for ~2 per SM, each split
    holding at least MIN_KEYS_PER_SPLIT keys, at most MAX_SPLITS. Large batches get 1."""
    programs = max(1, num_rows * num_kv_heads)
    want = -(-2 * num_sms // programs)
    by_length = -(-max_seq_len // MIN_KEYS_PER_SPLIT)
    return max(1, min(want, by_length, MAX_SPLITS))


@dataclass(frozen=True)
class DecodeConfig:
    block_n: int
    num_warps: int
    num_stages: int


def decode_config(head_dim: int) -> DecodeConfig:
    """Tile sizes for decode (GPU defaults; the interpreter just runs them)."""
    if _interpreting():
        return DecodeConfig(block_n=32, num_warps=1, num_stages=1)
    return DecodeConfig(block_n=64 if head_dim <= 128 else 32, num_warps=4, num_stages=2)


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    num_splits: int | None = 1,
    *,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    query_index: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    num_sms: int | None = None,
    split_counters: torch.Tensor | None = None,
) -> torch.Tensor:
    """Single-token attention per row through the paged cache.

    q [B, Hq, D] (or [T, Hq, D] with query_index [B]: row b's query is token query_index[b], and its
    output goes to out[query_index[b]]); block_tables [B, max_blocks] int32/int64 (null-padded);
    seq_lens [B] int32/int64 = keys per row (0 = padding row → zeros). Returns out [*, Hq, D].

    num_splits: split-K count (a launch parameter; the split boundaries come from seq_lens on the
    device). None picks `choose_num_splits` from seq_lens.max(), which syncs with the device.
    split_counters: int32, at least B * Hkv elements, all zero (and zero again after the launch), for
    the splits to find the last of them; None allocates zeros per call (one memset more). A caller
    that keeps one (`SplitCounters`) must not run two launches on it at once.
    k_scale, v_scale: an fp8 cache's scales (ignored for other caches)."""
    rows = block_tables.shape[0]
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[2]
    _check_cache(k_cache, v_cache, num_kv_heads, head_dim, q.dtype)
    assert num_heads % num_kv_heads == 0, f"Hq={num_heads} must be a multiple of Hkv={num_kv_heads}"
    assert q.stride(2) == 1 and block_tables.stride(1) == 1, "q head_dim and block_tables rows must be contiguous"
    assert seq_lens.shape == (rows,), "seq_lens must be [B]"
    if query_index is None:
        assert q.shape[0] == rows, "q must be [B, Hq, D] without query_index"
    else:
        assert query_index.shape == (rows,), "query_index must be [B]"
    if out is None:
        out = torch.empty_like(q)
    assert out.shape == q.shape and out.stride(2) == 1
    if rows == 0:
        return out
    if num_splits is None:
        sms = num_sms if num_sms is not None else device_sm_count(q.device)
        num_splits = choose_num_splits(rows, num_kv_heads, int(seq_lens.max()), sms)

    assert 1 <= num_splits <= MAX_SPLITS, f"num_splits must be in [1, {MAX_SPLITS}], got {num_splits}"
    group = num_heads // num_kv_heads
    cfg = decode_config(head_dim)
    block_d = max(16, triton.next_power_of_2(head_dim))
    ieee, upcast = _dot_flags(q.dtype)
    if num_splits > 1:
        part_acc = torch.empty(rows, num_heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
        part_m = torch.empty(rows, num_heads, num_splits, dtype=torch.float32, device=q.device)
        part_l = torch.empty_like(part_m)
        if split_counters is None:
            split_counters = torch.zeros(rows * num_kv_heads, dtype=torch.int32, device=q.device)
        assert (
            split_counters.dtype == torch.int32
            and split_counters.is_contiguous()
            and split_counters.numel() >= rows * num_kv_heads
        ), "split_counters must be int32, >= B * Hkv elements"
    else:
        part_acc = part_m = part_l = split_counters = out  # unused
    qidx = query_index if query_index is not None else seq_lens  # unused placeholder when None
    _decode_kernel[(rows, num_kv_heads, num_splits)](
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        qidx,
        out,
        part_acc,
        part_m,
        part_l,
        split_counters,
        _qk_scale(scale, k_cache, k_scale),
        float(v_scale),
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        block_tables.stride(0),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        num_splits,
        NUM_HEADS=num_heads,
        NUM_KV_HEADS=num_kv_heads,
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=k_cache.shape[1],
        BLOCK_G=max(16, triton.next_power_of_2(group)),
        BLOCK_N=cfg.block_n,
        BLOCK_D=block_d,
        BLOCK_S=triton.next_power_of_2(MAX_SPLITS),
        SPLIT=num_splits > 1,
        HAS_QIDX=query_index is not None,
        KV_FP8=is_fp8(k_cache),
        IEEE=ieee,
        UPCAST=upcast,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        **pdl.launch_args(q),
    )
    return out


class SplitCounters:
    """A caller-owned, always-zero counter buffer for `paged_decode_attention(split_counters=...)`,
    grown on demand. A CUDA graph keeps the address it captured, so a buffer that is outgrown stays
    alive (a captured graph may still use it); growing happens in the eager warm-up runs before a
    capture, as every launch size is first run eagerly."""

    def __init__(self) -> None:
        self._buffers: list[torch.Tensor] = []

    def get(self, rows: int, num_kv_heads: int, device: torch.device | str) -> torch.Tensor:
        need = rows * num_kv_heads
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:  # "cuda" is the current device
            device = torch.device("cuda", torch.cuda.current_device())
        current = self._buffers[-1] if self._buffers else None
        if current is None or current.numel() < need or current.device != device:
            current = torch.zeros(max(need, 1024), dtype=torch.int32, device=device)
            self._buffers.append(current)
        return current


# ---------------------------------------------------------------------------------------------
# Prefill: variable-length causal chunks, keys from the paged cache
# ---------------------------------------------------------------------------------------------


@triton.jit(do_not_specialize=["stride_table"])
def _prefill_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    tables_ptr,
    qsl_ptr,
    seq_lens_ptr,
    tile_req_ptr,
    tile_m0_ptr,
    out_ptr,
    qk_scale,
    v_scale,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_table,
    stride_kcb,
    stride_kcs,
    stride_kch,
    stride_vcb,
    stride_vcs,
    stride_vch,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    KV_FP8: tl.constexpr,
    IEEE: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """Program (tile, head): queries [m0, m0 + BLOCK_M) of request `req` for one query head.

    Query j of a request with q_len new tokens and seq_len keys sits at position
    ctx + j (ctx = seq_len - q_len, the cached prefix) and sees keys 0..ctx + j. Keys below
    ctx + m0 are visible to every row of the tile: those full tiles run without any mask; the rest,
    up to the tile's last row's position, run with the causal mask."""
    tile = tl.program_id(0)
    head = tl.program_id(1)
    kv_head = head // GROUP
    req = tl.load(tile_req_ptr + tile)
    m0 = tl.load(tile_m0_ptr + tile)
    q_start = tl.load(qsl_ptr + req)
    q_len = tl.load(qsl_ptr + req + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + req)
    ctx = seq_len - q_len

    offs_m = m0 + tl.arange(0, BLOCK_M)  # [BLOCK_M] query index in request
    offs_d = tl.arange(0, BLOCK_D)
    mask_q = (offs_m[:, None] < q_len) & (offs_d[None, :] < HEAD_DIM)  # [BLOCK_M, BLOCK_D]
    tokens = (q_start + offs_m).to(tl.int64)
    q = tl.load(q_ptr + tokens[:, None] * stride_qt + head * stride_qh + offs_d[None, :], mask=mask_q, other=0.0)
    q_pos = ctx + offs_m  # [BLOCK_M] positions

    m_i = tl.full([BLOCK_M], _NEG_BIG, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    table_row = tables_ptr + req.to(tl.int64) * stride_table
    full_end = (ctx + m0) // BLOCK_N * BLOCK_N  # keys < full_end: seen by all rows, all < seq_len
    key_end = tl.minimum(seq_len, ctx + m0 + BLOCK_M)  # one past the last valid row's position
    for n0 in range(0, full_end, BLOCK_N):
        m_i, l_i, acc = _attend_tile(
            q,
            m_i,
            l_i,
            acc,
            qk_scale,
            k_cache_ptr,
            v_cache_ptr,
            table_row,
            kv_head,
            n0,
            key_end,
            q_pos,
            stride_kcb,
            stride_kcs,
            stride_kch,
            stride_vcb,
            stride_vcs,
            stride_vch,
            HEAD_DIM,
            BLOCK_SIZE,
            BLOCK_N,
            BLOCK_D,
            False,
            False,
            KV_FP8,
            IEEE,
            UPCAST,
        )
    for n0 in range(full_end, key_end, BLOCK_N):
        m_i, l_i, acc = _attend_tile(
            q,
            m_i,
            l_i,
            acc,
            qk_scale,
            k_cache_ptr,
            v_cache_ptr,
            table_row,
            kv_head,
            n0,
            key_end,
            q_pos,
            stride_kcb,
            stride_kcs,
            stride_kch,
            stride_vcb,
            stride_vcs,
            stride_vch,
            HEAD_DIM,
            BLOCK_SIZE,
            BLOCK_N,
            BLOCK_D,
            True,
            True,
            KV_FP8,
            IEEE,
            UPCAST,
        )

    if KV_FP8:
        acc = acc * v_scale
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(
        out_ptr + tokens[:, None] * stride_ot + head * stride_oh + offs_d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=mask_q,
    )


@dataclass(frozen=True)
class PrefillTiles:
    """Work list for `_prefill_kernel`: tile i covers queries [m0[i], m0[i] + block_m) of request
    req[i] (an index into query_start_loc / seq_lens / block_tables). Built on the host from the
    query lengths the scheduler already knows, so launching needs no device reads."""

    req: torch.Tensor  # [num_tiles] int32
    m0: torch.Tensor  # [num_tiles] int32
    block_m: int

    @property
    def num_tiles(self) -> int:
        return self.req.shape[0]


def prefill_block_m() -> int:
    """Query tile height (fixed per process: `PrefillTiles` are built before head_dim is known)."""
    return 16 if _interpreting() else 64


def build_prefill_tiles(
    query_lens: Sequence[int], rows: Sequence[int], device: torch.device | str, block_m: int | None = None
) -> PrefillTiles:
    """Tiles for requests `rows` (indices into query_lens), each cut into ceil(q_len / block_m) tiles."""
    block_m = block_m or prefill_block_m()
    req, m0 = prefill_tile_arrays(query_lens, rows, block_m)
    return PrefillTiles(torch.from_numpy(req).to(device), torch.from_numpy(m0).to(device), block_m)


def prefill_tile_arrays(query_lens: Sequence[int], rows: Sequence[int], block_m: int) -> tuple[np.ndarray, np.ndarray]:
    """Host arrays (req, m0) int32 of `build_prefill_tiles`."""
    lens = np.asarray([query_lens[r] for r in rows], dtype=np.int64)
    counts = -(-lens // block_m)  # tiles per request
    req = np.repeat(np.asarray(rows, dtype=np.int32), counts)
    first = np.repeat(np.cumsum(counts) - counts, counts)  # index of each tile's first sibling
    m0 = ((np.arange(int(counts.sum())) - first) * block_m).astype(np.int32)
    return req, m0


def prefill_config(head_dim: int) -> tuple[int, int, int]:
    """(BLOCK_N, num_warps, num_stages) for prefill (GPU defaults)."""
    if _interpreting():
        return 32, 1, 1
    return 64, (4 if head_dim <= 64 else 8), (3 if head_dim <= 64 else 2)


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    tiles: PrefillTiles | None = None,
    out: torch.Tensor | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Causal attention of packed chunks q [T, Hq, D] (request b's queries are
    q[query_start_loc[b]:query_start_loc[b+1]], at positions seq_len - q_len + j) over keys
    0..position read from the paged cache (store the chunk's K/V first). → out [T, Hq, D].

    tiles: which requests to run (default: all, built from query_start_loc.tolist(), a device
    sync); rows not covered by a tile are left untouched in `out`. k_scale, v_scale: an fp8 cache's
    scales (ignored for other caches)."""
    rows = block_tables.shape[0]
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[2]
    _check_cache(k_cache, v_cache, num_kv_heads, head_dim, q.dtype)
    assert num_heads % num_kv_heads == 0, f"Hq={num_heads} must be a multiple of Hkv={num_kv_heads}"
    assert q.stride(2) == 1 and block_tables.stride(1) == 1, "q head_dim and block_tables rows must be contiguous"
    assert query_start_loc.shape == (rows + 1,) and seq_lens.shape == (rows,)
    if out is None:
        out = torch.empty_like(q)
    assert out.shape == q.shape and out.stride(2) == 1
    if tiles is None:
        starts = query_start_loc.tolist()
        lens = [b - a for a, b in itertools.pairwise(starts)]
        tiles = build_prefill_tiles(lens, [i for i, n in enumerate(lens) if n > 0], q.device)
    if tiles.num_tiles == 0:
        return out
    block_n, num_warps, num_stages = prefill_config(head_dim)
    ieee, upcast = _dot_flags(q.dtype)
    _prefill_kernel[(tiles.num_tiles, num_heads)](
        q,
        k_cache,
        v_cache,
        block_tables,
        query_start_loc,
        seq_lens,
        tiles.req,
        tiles.m0,
        out,
        _qk_scale(scale, k_cache, k_scale),
        float(v_scale),
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        block_tables.stride(0),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        GROUP=num_heads // num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=k_cache.shape[1],
        BLOCK_M=tiles.block_m,
        BLOCK_N=block_n,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        KV_FP8=is_fp8(k_cache),
        IEEE=ieee,
        UPCAST=upcast,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return out


# ---------------------------------------------------------------------------------------------
# Start-up compilation
# ---------------------------------------------------------------------------------------------


def compile_variants(
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device | str,
    cache_dtype: torch.dtype | None = None,
) -> None:
    """Launch each kernel once in every variant a step can need for this attention shape, on a tiny
    scratch cache, so Triton compiles them at start-up rather than inside a step (a compile stalls
    every running request for ~0.5 s). The variants are the launch constexprs that differ between
    steps: decode with and without a query index (mixed vs pure-decode steps), each with one split
    and with several (then the in-kernel merge); prefill; store_kv. What else changes from step to
    step (row counts, block-table widths, split counts) is passed as unspecialised runtime integers.
    Each once with and once without PDL: steps (eager or captured) of more than
    `dispatch.PDL_MAX_ROWS` tokens launch without it (`dispatch.pdl_for_rows`). cache_dtype: the
    cache's element type (None: dtype; `FP8` compiles the fp8-cache variants)."""
    for pdl_on in (True, False):
        with dispatch.pdl_allowed(pdl_on):
            _launch_variants(num_heads, num_kv_heads, head_dim, block_size, dtype, device, cache_dtype or dtype)


def _launch_variants(
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device | str,
    cache_dtype: torch.dtype,
) -> None:
    blocks = 3
    k_cache = torch.zeros(blocks, block_size, num_kv_heads, head_dim, dtype=cache_dtype, device=device)
    v_cache = torch.zeros_like(k_cache)
    tables = torch.tensor([[1, 2]], dtype=torch.int32, device=device)
    q = torch.zeros(2, num_heads, head_dim, dtype=dtype, device=device)
    kv = torch.zeros(2, num_kv_heads, head_dim, dtype=dtype, device=device)
    store_kv(kv, kv, k_cache, v_cache, torch.tensor([block_size, block_size + 1], device=device))
    seq_len = torch.tensor([2], dtype=torch.int32, device=device)
    for splits, index in itertools.product((1, 2), (None, torch.tensor([1], dtype=torch.int32, device=device))):
        paged_decode_attention(
            q if index is not None else q[:1], k_cache, v_cache, tables, seq_len, 1.0, splits, query_index=index
        )
    paged_prefill_attention(
        q,
        k_cache,
        v_cache,
        tables,
        torch.tensor([0, 2], dtype=torch.int32, device=device),
        seq_len,
        1.0,
        tiles=build_prefill_tiles([2], [0], device),
    )


# ---------------------------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------------------------


def _check_cache(
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


def _qk_scale(scale: float, k_cache: torch.Tensor, k_scale: float) -> float:
    """The kernels' score multiplier: softmax scale (times an fp8 cache's k_scale) in the log2 domain."""
    return scale * (float(k_scale) if is_fp8(k_cache) else 1.0) * _LOG2E


_SM_COUNTS: dict[int, int] = {}


def device_sm_count(device: torch.device | str) -> int:
    """Streaming multiprocessors of a CUDA device (cached); 1 elsewhere (the interpreter runs programs
    one after another, so splitting only costs time there)."""
    device = torch.device(device)
    if device.type != "cuda":
        return 1
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM_COUNTS:
        _SM_COUNTS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SM_COUNTS[index]
