"""Decode attention: one query token per row through the paged cache, all query heads of a KV head in
one program, the keys split across programs (split-K) when a batch has too few rows to fill the GPU,
the splits merged by the last one to finish.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pagoda.kernels import pdl
from pagoda.kernels.attention.store_kv import check_cache, is_fp8
from pagoda.kernels.attention.tile import NEG_BIG, attend_tile, score_scale
from pagoda.kernels.pdl import wait_for_inputs
from pagoda.kernels.triton_utils import dot_flags, interpreting

# Split-K rule (decode): aim for ~2 programs per SM, but never give a split fewer than this many keys
# (below that the partial write + merge cost more than the parallelism buys) nor more splits than this.
MIN_KEYS_PER_SPLIT = 256
MAX_SPLITS = 64


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
    q_strides,  # q.stride(): (token, head, dim)
    o_strides,  # out.stride()
    stride_table,
    kc_strides,  # k_cache.stride(): (block, slot, head, dim)
    vc_strides,
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
    if seq_len == 0:  # a padding row (a graph bucket's spare rows): zeros, written once, and no split work
        if split == 0:
            zeros = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
            tl.store(
                out_ptr + token * o_strides[0] + heads[:, None] * o_strides[1] + offs_d[None, :],
                zeros.to(out_ptr.dtype.element_ty),
                mask=mask_q,
            )
        return
    q = tl.load(q_ptr + token * q_strides[0] + heads[:, None] * q_strides[1] + offs_d[None, :], mask=mask_q, other=0.0)

    tiles_per_split = tl.cdiv(tl.cdiv(seq_len, BLOCK_N), num_splits)
    start = split * tiles_per_split * BLOCK_N
    end = tl.minimum(start + tiles_per_split * BLOCK_N, seq_len)
    m_i = tl.full([BLOCK_G], NEG_BIG, tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    table_row = tables_ptr + row.to(tl.int64) * stride_table
    for n0 in range(start, end, BLOCK_N):
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
            end,
            0,
            kc_strides,
            vc_strides,
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
        out = acc / l_i[:, None]  # > 0: the row has keys (padding rows returned above)
        tl.store(
            out_ptr + token * o_strides[0] + heads[:, None] * o_strides[1] + offs_d[None, :],
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
                out_ptr + token * o_strides[0],
                o_strides[1],
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
    holding at least MIN_KEYS_PER_SPLIT keys, at most MAX_SPLITS. A batch whose (row, kv head) programs
    number at least the SMs gets 1: there a split only adds its partials' writes and the merge
    (`benchmarks/kernels/decode_kernel_sweep.py`, docs/performance.md)."""
    programs = max(1, num_rows * num_kv_heads)
    if programs >= num_sms:
        return 1
    want = -(-2 * num_sms // programs)
    by_length = -(-max_seq_len // MIN_KEYS_PER_SPLIT)
    return max(1, min(want, by_length, MAX_SPLITS))


@dataclass(frozen=True)
class DecodeConfig:
    block_n: int
    num_warps: int
    num_stages: int


def decode_config(head_dim: int, num_splits: int = 1) -> DecodeConfig:
    """Tile sizes for decode (GPU defaults; the interpreter just runs them). A split program walks a few key
    tiles only, and at head dim 128 two warps finish it sooner than four (`decode_kernel_sweep.py`, 1 to 64 rows
    of ~1,100 keys); other head dims keep four until they are swept."""
    if interpreting():
        return DecodeConfig(block_n=32, num_warps=1, num_stages=1)
    warps = 2 if num_splits > 1 and head_dim == 128 else 4
    return DecodeConfig(block_n=64 if head_dim <= 128 else 32, num_warps=warps, num_stages=2)


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
    check_cache(k_cache, v_cache, num_kv_heads, head_dim, q.dtype)
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
    cfg = decode_config(head_dim, num_splits)
    block_d = max(16, triton.next_power_of_2(head_dim))
    ieee, upcast = dot_flags(q.dtype)
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
        score_scale(scale, k_cache, k_scale),
        float(v_scale),
        q.stride(),
        out.stride(),
        block_tables.stride(0),
        k_cache.stride(),
        v_cache.stride(),
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
