"""Paged attention in plain PyTorch: the reference backend, and the CPU backend.

It reads K/V only through block tables: a request's context is gathered block by block
(`index_select` of whole blocks, faster on the CPU than gathering single slots), never taken
from a per-request contiguous cache. Decode rows (one query token each) are attended together as a
padded batch with a key-padding mask; prefill chunks are attended one request at a time with a
causal mask offset by the number of already-cached tokens.

On the CPU, a request whose blocks are one ascending run of block ids (what the block manager hands a
request running alone; concurrent requests' blocks interleave as they grow) is attended in place: its
keys are a view of the cache, the slots [first, first + length), and nothing is copied. Every prefill
row that is one run is; decode rows are when every decode row of the step is one run and there are at
most `policy.CPU_KV_VIEW_MAX_ROWS` of them, since then one attention call per row costs less than one
gathered batch. A cache narrower than
the model (fp8, bf16 beside float32) is always gathered: the gather is what widens it. Switch:
`PAGODA_CPU_KV_IN_PLACE=0`. A batch of `rows_alone` (a verification step's tokens as decode rows) attends each
row in the very calls a step of that row alone makes: in place on one run, else its own blocks gathered.

Attention calls take 4-D inputs [1, H, L, D]: with 3-D ones PyTorch's CPU SDPA runs grouped-query
attention on its math path, repeating K and V for every query head.

Gathered blocks may hold slots past a request's length: those are masked out, and they are never
NaN garbage because the model runner zeroes every block when it is handed out
(`needs_zeroed_blocks`; the null block 0 that pads tables is zeroed at allocation).

An fp8 cache (see `pagoda/layers/attention.py`) stores `quantize_kv(k, k_scale)`; the gathered e4m3
blocks are widened exactly to q's dtype and the scales folded into the attention as the Triton
kernels fold them: k_scale into SDPA's scale, v_scale onto the output. That is attention over the
dequantized cache, without a scaled copy of every gathered block.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from pagoda import envs
from pagoda.kernels import policy
from pagoda.layers.attention import FP8_KV, AttentionBackend, AttentionBatch, quantize_kv


@dataclass
class _PrefillRow:
    start: int  # first token of this request in the flat axis
    end: int  # one past its last token
    blocks: torch.Tensor  # [nblk] block ids holding positions [0, nblk * block_size)
    mask: torch.Tensor | None  # [q_len, nblk * block_size] bool (True = attend); None = plain causal
    first_slot: int | None  # the slot of position 0 when the blocks are one run (attended in place)
    length: int  # keys: cached + new


@dataclass
class DecodeView:
    token: int  # flat index of the row's query token
    first_slot: int  # the slot of its position 0
    length: int  # keys


@dataclass
class _AloneRow:
    """A decode row attended as a step of it alone attends it: in place when its blocks are one run, else its own
    blocks gathered, padded to whole blocks and masked (the one-row case of the gathered batch)."""

    token: torch.Tensor  # [1] flat index of its query token
    view: DecodeView | None
    blocks: torch.Tensor  # [nblk] its block ids
    mask: torch.Tensor  # [1, 1, 1, nblk * block_size] bool


@dataclass
class TorchAttentionMetadata:
    slot_mapping: torch.Tensor  # [T]
    decode_token_index: torch.Tensor | None  # [Bd] flat index of each decode row's query token
    decode_blocks: torch.Tensor | None  # [Bd * nblk] block ids, row-major (null-padded)
    decode_mask: torch.Tensor | None  # [Bd, 1, 1, nblk * block_size] bool key-padding mask
    prefill_rows: list[_PrefillRow]
    decode_views: list[DecodeView] | None = None  # the decode rows in place, when every one is one run
    lone: DecodeView | None = None  # the step's only row, a decode row in place (`models/llama_cpu_decode.py`)
    alone: list[_AloneRow] | None = None  # `AttentionBatch.rows_alone`: each decode row on its own


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def __init__(self) -> None:
        self.in_place = envs.CPU_KV_IN_PLACE.value  # read once: the switch is set before the process starts

    def prepare(self, batch: AttentionBatch) -> TorchAttentionMetadata:
        starts = batch.query_start_loc.tolist()
        bs = batch.block_size
        decode = [i for i, n in enumerate(batch.query_lens) if n == 1]
        prefill = [i for i, n in enumerate(batch.query_lens) if n > 1]
        device = batch.slot_mapping.device

        # Block runs are read on the host: only where the cache is host memory (no device sync).
        in_place = device.type == "cpu" and self.in_place
        tables = batch.block_tables.numpy() if in_place else None
        decode_index = decode_blocks = decode_mask = decode_views = alone = None
        if batch.rows_alone:
            alone = [self._alone(batch, i, tables) for i in decode]
        elif in_place and 0 < len(decode) <= policy.CPU_KV_VIEW_MAX_ROWS:
            firsts = [_first_slot(tables[i], batch.seq_lens[i], bs) for i in decode]
            if all(f is not None for f in firsts):
                decode_views = [DecodeView(starts[i], f, batch.seq_lens[i]) for i, f in zip(decode, firsts)]
        if decode and alone is None:
            rows = torch.tensor(decode, device=device)
            lens = batch.seq_lens_tensor[rows]  # [Bd]
            num_blocks = -(-max(batch.seq_lens[i] for i in decode) // bs)
            decode_blocks = batch.block_tables[rows, :num_blocks].reshape(-1)  # [Bd * nblk]
            pos = torch.arange(num_blocks * bs, device=device)
            decode_mask = (pos[None, :] < lens[:, None])[:, None, None, :]  # [Bd, 1, 1, nblk * bs]
            decode_index = batch.query_start_loc[rows]

        prefill_rows = []
        for i in prefill:
            q_len, length = batch.query_lens[i], batch.seq_lens[i]
            num_blocks = -(-length // bs)
            mask = None
            if length > q_len or num_blocks * bs != length:
                # query j sits at position (length - q_len + j) and sees keys up to and including it
                q_pos = torch.arange(length - q_len, length, device=device)
                mask = torch.arange(num_blocks * bs, device=device)[None, :] <= q_pos[:, None]
            first = _first_slot(tables[i], length, bs) if in_place else None
            row = _PrefillRow(starts[i], starts[i + 1], batch.block_tables[i, :num_blocks], mask, first, length)
            prefill_rows.append(row)
        lone = decode_views[0] if decode_views is not None and len(batch.query_lens) == 1 else None
        return TorchAttentionMetadata(
            batch.slot_mapping, decode_index, decode_blocks, decode_mask, prefill_rows, decode_views, lone, alone
        )

    @staticmethod
    def _alone(batch: AttentionBatch, i: int, tables: np.ndarray | None) -> _AloneRow:
        length, bs = batch.seq_lens[i], batch.block_size
        start = batch.query_start_loc[i : i + 1]
        first = _first_slot(tables[i], length, bs) if tables is not None else None
        view = None if first is None else DecodeView(int(start), first, length)
        num_blocks = -(-length // bs)
        mask = (torch.arange(num_blocks * bs, device=start.device) < length)[None, None, None, :]
        return _AloneRow(start, view, batch.block_tables[i, :num_blocks], mask)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        metadata: TorchAttentionMetadata,
        scale: float,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
    ) -> torch.Tensor:
        num_kv_heads, head_dim = k.shape[1], k.shape[2]
        flat_k = k_cache.view(-1, num_kv_heads, head_dim)  # [num_blocks * block_size, Hkv, D]
        flat_v = v_cache.view(-1, num_kv_heads, head_dim)
        fp8 = k_cache.dtype == FP8_KV
        # A cache narrower than the model (fp8, or bf16 beside float32 weights) stores rounded values; the
        # gathers below widen them back to q's dtype.
        flat_k[metadata.slot_mapping] = quantize_kv(k, k_scale) if fp8 else k.to(flat_k.dtype)
        flat_v[metadata.slot_mapping] = quantize_kv(v, v_scale) if fp8 else v.to(flat_v.dtype)
        if fp8:
            scale = scale * k_scale
        else:
            v_scale = 1.0
        gqa = q.shape[1] != num_kv_heads
        out = torch.empty_like(q)
        in_place = k_cache.dtype == q.dtype  # a narrower cache is widened by its gather

        if metadata.alone is not None:  # each row in the very calls a step of that row alone makes (`_alone`)
            for alone in metadata.alone:
                if in_place and alone.view is not None:
                    _decode_in_place(out, q, flat_k, flat_v, alone.view, scale)
                else:
                    _decode_gathered(out, q, k_cache, v_cache, alone.token, alone.blocks, alone.mask, scale, v_scale)
        elif in_place and metadata.decode_views is not None:
            for view in metadata.decode_views:
                _decode_in_place(out, q, flat_k, flat_v, view, scale)
        elif metadata.decode_blocks is not None:
            assert metadata.decode_token_index is not None and metadata.decode_mask is not None
            index, blocks, mask = metadata.decode_token_index, metadata.decode_blocks, metadata.decode_mask
            _decode_gathered(out, q, k_cache, v_cache, index, blocks, mask, scale, v_scale)

        for row in metadata.prefill_rows:
            qp = q[row.start : row.end].transpose(0, 1)[None]  # [1, Hq, n, D]
            mask = row.mask
            if in_place and row.first_slot is not None:
                keys = slice(row.first_slot, row.first_slot + row.length)
                kp, vp = flat_k[keys].transpose(0, 1)[None], flat_v[keys].transpose(0, 1)[None]  # [1, Hkv, L, D]
                mask = None if mask is None else mask[:, : row.length]
            else:
                kp = _gather(k_cache, row.blocks, 1, q.dtype)  # [1, Hkv, nblk * bs, D]
                vp = _gather(v_cache, row.blocks, 1, q.dtype)
            # 4-D, as for decode: 3-D GQA inputs take SDPA's math path, which repeats K/V per query head.
            op = F.scaled_dot_product_attention(
                qp, kp, vp, attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=gqa
            )[0]
            out[row.start : row.end] = op.transpose(0, 1) if v_scale == 1.0 else op.transpose(0, 1) * v_scale
        return out


def _decode_in_place(
    out: torch.Tensor, q: torch.Tensor, flat_k: torch.Tensor, flat_v: torch.Tensor, row: DecodeView, scale: float
) -> None:
    """out[row's token] = its attention over its keys read in place (q, out [T, Hq, D])."""
    out[row.token] = attend_in_place(q[row.token][None, :, None], flat_k, flat_v, row, scale)[0, :, 0]


def _decode_gathered(
    out: torch.Tensor,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    index: torch.Tensor,
    blocks: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    v_scale: float,
) -> None:
    """out[index] = the attention of those Bd decode rows over their blocks gathered as one padded batch
    (blocks [Bd * nblk], mask [Bd, 1, 1, nblk * block_size])."""
    num_rows = index.shape[0]
    qd = q[index].unsqueeze(2)  # [Bd, Hq, 1, D]
    kd = _gather(k_cache, blocks, num_rows, q.dtype)  # [Bd, Hkv, nblk*bs, D]
    vd = _gather(v_cache, blocks, num_rows, q.dtype)
    gqa = q.shape[1] != k_cache.shape[2]
    od = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=mask, scale=scale, enable_gqa=gqa)  # [Bd, Hq, 1, D]
    out[index] = od.squeeze(2) if v_scale == 1.0 else od.squeeze(2) * v_scale


def attend_in_place(
    q: torch.Tensor, flat_k: torch.Tensor, flat_v: torch.Tensor, row: DecodeView, scale: float
) -> torch.Tensor:
    """q [1, Hq, 1, D] of one decode row over its keys read in place, slots [first_slot, first_slot + length) of the
    caches [slots, Hkv, D] → [1, Hq, 1, D]. 4-D: PyTorch's CPU SDPA runs GQA there without repeating K/V (3-D
    inputs fall back to that)."""
    keys = slice(row.first_slot, row.first_slot + row.length)
    return F.scaled_dot_product_attention(
        q,
        flat_k[keys].transpose(0, 1)[None],  # [1, Hkv, L, D], a view of the cache
        flat_v[keys].transpose(0, 1)[None],
        scale=scale,
        enable_gqa=q.shape[1] != flat_k.shape[1],
    )


def _first_slot(table: np.ndarray, length: int, block_size: int) -> int | None:
    """The slot of position 0 when the blocks holding `length` positions are consecutive ids, else None."""
    blocks = table[: -(-length // block_size)]
    if not (np.diff(blocks) == 1).all():
        return None
    return int(blocks[0]) * block_size


def _gather(cache: torch.Tensor, blocks: torch.Tensor, num_rows: int, dtype: torch.dtype) -> torch.Tensor:
    """cache [num_blocks, bs, Hkv, D], blocks [rows * nblk] → [rows, Hkv, nblk * bs, D] of `dtype` (a
    strided view of one contiguous gathered copy; e4m3 and bf16 widen exactly)."""
    gathered = torch.index_select(cache, 0, blocks).to(dtype)  # [rows * nblk, bs, Hkv, D]
    return gathered.view(num_rows, -1, cache.shape[2], cache.shape[3]).transpose(1, 2)
