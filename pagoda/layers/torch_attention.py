"""Paged attention in plain PyTorch: the reference backend, and the CPU backend.

It reads K/V only through block tables (gathering the slots a request's context occupies), never
from a per-request contiguous cache. Decode rows (one query token each) are attended together as a
padded batch with a key-padding mask; prefill chunks are attended one request at a time with a
causal mask offset by the number of already-cached tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pagoda.layers.attention import AttentionBackend, AttentionBatch


@dataclass
class _PrefillRow:
    start: int                     # first token of this request in the flat axis
    end: int                       # one past its last token
    slots: torch.Tensor            # [L] context slots (cached prefix + new tokens), in position order
    mask: torch.Tensor | None      # [q_len, L] bool (True = attend), None = plain causal (no prefix)


@dataclass
class TorchAttentionMetadata:
    slot_mapping: torch.Tensor            # [T]
    decode_token_index: torch.Tensor | None  # [Bd] flat index of each decode row's query token
    decode_slots: torch.Tensor | None     # [Bd, Lmax] context slots per decode row (null-padded)
    decode_mask: torch.Tensor | None      # [Bd, 1, 1, Lmax] bool key-padding mask
    prefill_rows: list[_PrefillRow]


def context_slots(block_table: torch.Tensor, length: int, block_size: int) -> torch.Tensor:
    """Cache slots of positions [0, length) for one request's block table ([max_blocks])."""
    pos = torch.arange(length, device=block_table.device)
    return block_table[pos // block_size] * block_size + pos % block_size


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def prepare(self, batch: AttentionBatch) -> TorchAttentionMetadata:
        starts = batch.query_start_loc.tolist()
        bs = batch.block_size
        decode = [i for i, n in enumerate(batch.query_lens) if n == 1]
        prefill = [i for i, n in enumerate(batch.query_lens) if n > 1]
        device = batch.slot_mapping.device

        decode_index = decode_slots = decode_mask = None
        if decode:
            rows = torch.tensor(decode, device=device)
            lens = batch.seq_lens_tensor[rows]                                    # [Bd]
            max_len = max(batch.seq_lens[i] for i in decode)
            pos = torch.arange(max_len, device=device)                            # [Lmax]
            tables = batch.block_tables[rows]                                     # [Bd, max_blocks]
            valid = pos[None, :] < lens[:, None]                                  # [Bd, Lmax]
            # Padding reads slot 0 (the zeroed null block), never an unwritten slot: the cache is
            # allocated uninitialised, and NaN garbage would survive a zero attention weight.
            decode_slots = torch.where(valid, tables[:, pos // bs] * bs + pos % bs, 0)  # [Bd, Lmax]
            decode_mask = valid[:, None, None, :]                                 # [Bd, 1, 1, Lmax]
            decode_index = batch.query_start_loc[rows]

        prefill_rows = []
        for i in prefill:
            q_len, length = batch.query_lens[i], batch.seq_lens[i]
            slots = context_slots(batch.block_tables[i], length, bs)
            mask = None
            if length > q_len:
                # query j sits at position (length - q_len + j) and sees keys up to and including it
                q_pos = torch.arange(length - q_len, length, device=device)
                mask = torch.arange(length, device=device)[None, :] <= q_pos[:, None]
            prefill_rows.append(_PrefillRow(starts[i], starts[i + 1], slots, mask))
        return TorchAttentionMetadata(batch.slot_mapping, decode_index, decode_slots, decode_mask, prefill_rows)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, metadata: TorchAttentionMetadata, scale: float) -> torch.Tensor:
        num_kv_heads, head_dim = k.shape[1], k.shape[2]
        flat_k = k_cache.view(-1, num_kv_heads, head_dim)     # [num_blocks * block_size, Hkv, D]
        flat_v = v_cache.view(-1, num_kv_heads, head_dim)
        flat_k[metadata.slot_mapping] = k
        flat_v[metadata.slot_mapping] = v
        gqa = q.shape[1] != num_kv_heads
        out = torch.empty_like(q)

        if metadata.decode_slots is not None:
            qd = q[metadata.decode_token_index].unsqueeze(2)                  # [Bd, Hq, 1, D]
            kd = flat_k[metadata.decode_slots].transpose(1, 2)                # [Bd, Hkv, Lmax, D]
            vd = flat_v[metadata.decode_slots].transpose(1, 2)
            od = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=metadata.decode_mask,
                                                scale=scale, enable_gqa=gqa)  # [Bd, Hq, 1, D]
            out[metadata.decode_token_index] = od.squeeze(2)

        for row in metadata.prefill_rows:
            qp = q[row.start:row.end].transpose(0, 1)                         # [Hq, n, D]
            kp = flat_k[row.slots].transpose(0, 1)                            # [Hkv, L, D]
            vp = flat_v[row.slots].transpose(0, 1)
            op = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=row.mask, is_causal=row.mask is None,
                                                scale=scale, enable_gqa=gqa)
            out[row.start:row.end] = op.transpose(0, 1)
        return out
