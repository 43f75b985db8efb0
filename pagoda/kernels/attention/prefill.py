"""Prefill attention: variable-length causal chunks (a request's new tokens, after any cached prefix),
keys read from the paged cache, over a host-built list of query tiles.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import triton
import triton.language as tl

from pagoda.device_copy import to_device
from pagoda.kernels.attention.store_kv import check_cache, is_fp8
from pagoda.kernels.attention.tile import NEG_BIG, attend_tile, score_scale
from pagoda.kernels.triton_utils import dot_flags, interpreting


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
    q_strides,  # q.stride(): (token, head, dim)
    o_strides,  # out.stride()
    stride_table,
    kc_strides,  # k_cache.stride(): (block, slot, head, dim)
    vc_strides,
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
    if m0 >= q_len:  # an unused tile of a graph bucket (it points at a row without queries): nothing to do
        return
    seq_len = tl.load(seq_lens_ptr + req)
    ctx = seq_len - q_len

    offs_m = m0 + tl.arange(0, BLOCK_M)  # [BLOCK_M] query index in request
    offs_d = tl.arange(0, BLOCK_D)
    mask_q = (offs_m[:, None] < q_len) & (offs_d[None, :] < HEAD_DIM)  # [BLOCK_M, BLOCK_D]
    tokens = (q_start + offs_m).to(tl.int64)
    q = tl.load(q_ptr + tokens[:, None] * q_strides[0] + head * q_strides[1] + offs_d[None, :], mask=mask_q, other=0.0)
    q_pos = ctx + offs_m  # [BLOCK_M] positions

    m_i = tl.full([BLOCK_M], NEG_BIG, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    table_row = tables_ptr + req.to(tl.int64) * stride_table
    full_end = (ctx + m0) // BLOCK_N * BLOCK_N  # keys < full_end: seen by all rows, all < seq_len
    key_end = tl.minimum(seq_len, ctx + m0 + BLOCK_M)  # one past the last valid row's position
    for n0 in range(0, full_end, BLOCK_N):
        m_i, l_i, acc = attend_tile(
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
            kc_strides,
            vc_strides,
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
        m_i, l_i, acc = attend_tile(
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
            kc_strides,
            vc_strides,
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
        out_ptr + tokens[:, None] * o_strides[0] + head * o_strides[1] + offs_d[None, :],
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
    return 16 if interpreting() else 64


def build_prefill_tiles(
    query_lens: Sequence[int], rows: Sequence[int], device: torch.device | str, block_m: int | None = None
) -> PrefillTiles:
    """Tiles for requests `rows` (indices into query_lens), each cut into ceil(q_len / block_m) tiles."""
    block_m = block_m or prefill_block_m()
    req, m0 = prefill_tile_arrays(query_lens, rows, block_m)
    return PrefillTiles(to_device(req, device), to_device(m0, device), block_m)


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
    if interpreting():
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
    check_cache(k_cache, v_cache, num_kv_heads, head_dim, q.dtype)
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
    ieee, upcast = dot_flags(q.dtype)
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
        score_scale(scale, k_cache, k_scale),
        float(v_scale),
        q.stride(),
        out.stride(),
        block_tables.stride(0),
        k_cache.stride(),
        v_cache.stride(),
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
