"""The step both attention kernels repeat: fold one tile of keys from the paged cache into the online
softmax of a block of query rows.

All softmax arithmetic is fp32 in the log2 domain (fp32 scores are multiplied by scale * log2(e),
then `exp2`), with the running max started at a large finite negative value rather than -inf so a
row that has seen no key yet never computes `-inf - -inf = NaN`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagoda.kernels.attention.store_kv import is_fp8
from pagoda.kernels.triton_utils import mma

_LOG2E = 1.4426950408889634
NEG_BIG = tl.constexpr(-1.0e30)  # running-max start: finite, so exp2(m_old - m_new) is never NaN


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
def attend_tile(
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
    kc_strides,
    vc_strides,
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
    block_size (a tile may span several cache blocks, or part of one); kc_strides / vc_strides are
    the caches' `.stride()` (block, slot, head, dim).
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
    k_off = block * kc_strides[0] + within * kc_strides[1] + kv_head * kc_strides[2]  # [BLOCK_N] int64
    k = _load_kv_rows(k_cache_ptr, k_off, offs_d, mask_n, HEAD_DIM, BLOCK_D, MASK_KEYS)  # [BLOCK_N, BLOCK_D]
    if KV_FP8:
        k = k.to(q.dtype)
    s = mma(q, tl.trans(k), IEEE, UPCAST) * qk_scale  # [M, BLOCK_N] log2 domain
    if CAUSAL:
        s = tl.where((offs_n[None, :] <= q_pos[:, None]) & mask_n[None, :], s, float("-inf"))
    elif MASK_KEYS:
        s = tl.where(mask_n[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])  # [M, BLOCK_N]
    l_i = l_i * alpha + tl.sum(p, 1)
    v_off = block * vc_strides[0] + within * vc_strides[1] + kv_head * vc_strides[2]
    v = _load_kv_rows(v_cache_ptr, v_off, offs_d, mask_n, HEAD_DIM, BLOCK_D, MASK_KEYS)  # [BLOCK_N, BLOCK_D]
    if KV_FP8:
        v = v.to(q.dtype)
    acc = acc * alpha[:, None] + mma(p.to(v.dtype), v, IEEE, UPCAST)
    return m_new, l_i, acc


def score_scale(scale: float, k_cache: torch.Tensor, k_scale: float) -> float:
    """The kernels' score multiplier: softmax scale (times an fp8 cache's k_scale) in the log2 domain."""
    return scale * (float(k_scale) if is_fp8(k_cache) else 1.0) * _LOG2E
