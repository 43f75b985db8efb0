"""Paged attention through Triton kernels (`pagoda/kernels/attention/`): the GPU backend.

`prepare` runs once per step on the host values the runner already has (query lengths, sequence
lengths): it splits rows into decode rows (one new token) and prefill rows (a chunk of several,
possibly after a cached prefix), converts indices to int32 on the device, and builds the prefill
tile list. `forward` then runs per layer with no host-device sync and no Python loop over requests
(store K/V, one decode launch (split-K merged in-kernel), one prefill launch), so a decode step can be
captured in a CUDA graph later; for that, fix the split count (`decode_splits`), since the rule
depends on the step's longest sequence, and copy the step's values into static buffers (padding
rows: seq_len 0 gives zeros, slot -1 stores nothing) — `decode_metadata` builds the metadata over
such buffers (`pagoda/worker/graph_runner.py`).

Numerics match `TorchAttentionBackend` (fp32 softmax, fp32 accumulation), except that the kernels
never read cache slots at or past a row's length, so they do not rely on blocks being zeroed. An fp8
cache (e4m3, per-layer k_scale/v_scale) is handled inside the kernels: quantized by the store (or the
fused RoPE store), the scales folded into the attention (`pagoda/kernels/attention/store_kv.py`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from pagoda.device_copy import to_device
from pagoda.kernels import dispatch
from pagoda.layers.attention import AttentionBackend, AttentionBatch
from pagoda.layers.torch_attention import TorchAttentionBackend

if TYPE_CHECKING:
    from types import ModuleType

    from pagoda.kernels.attention.prefill import PrefillTiles


@dataclass(frozen=True)
class _Kernels:
    """The attention kernel modules (`pagoda/kernels/attention/`), one per family."""

    store: ModuleType  # store_kv
    decode: ModuleType  # paged_decode_attention, split-K rule, SplitCounters
    prefill: ModuleType  # paged_prefill_attention, PrefillTiles
    warmup: ModuleType  # compile_variants


def _load_kernels() -> _Kernels:
    """Import the kernels on first use, not with this module: `@triton.jit` picks compiled vs
    interpreted mode (TRITON_INTERPRET) when the kernels are defined, and importing this module
    (e.g. from the model runner) must not fix that choice for a CPU-only process."""
    from pagoda.kernels.attention import decode, prefill, store_kv, warmup  # lazy: triton (see above)

    return _Kernels(store_kv, decode, prefill, warmup)


@dataclass
class _DecodeRows:
    """Rows with exactly one new token, attended by the decode kernel."""

    token_index: torch.Tensor | None  # [Bd] int32 flat token of each row's query; None = row i is token i
    block_tables: torch.Tensor  # [Bd, max_blocks] int32
    seq_lens: torch.Tensor  # [Bd] int32
    max_seq_len: int  # host value, for the split-count rule

    @property
    def num_rows(self) -> int:
        return self.seq_lens.shape[0]


@dataclass
class TritonAttentionMetadata:
    slot_mapping: torch.Tensor  # [T] cache slot of each new token
    decode: _DecodeRows | None
    prefill_tiles: PrefillTiles | None  # work list over the prefill rows; None = no prefill rows
    block_tables: torch.Tensor  # [B, max_blocks] int32 (prefill kernel indexes it by request)
    query_start_loc: torch.Tensor  # [B + 1] int32
    seq_lens: torch.Tensor  # [B] int32
    num_sms: int


class TritonAttentionBackend(AttentionBackend):
    """Triton paged attention. `decode_splits` pins the decode split-K count (None = choose per step
    from batch size, KV heads and the longest sequence); `num_sms` overrides the device's SM count."""

    name = "triton"
    needs_zeroed_blocks = False  # the kernels mask every load past seq_len (pagoda/kernels/attention/)

    def __init__(self, decode_splits: int | None = None, num_sms: int | None = None):
        assert decode_splits is None or decode_splits >= 1
        self._kernels = _load_kernels()  # ImportError without the `triton` package
        self.decode_splits = decode_splits
        self.num_sms = num_sms
        self._split_counters = self._kernels.decode.SplitCounters()  # one backend per model runner: launches in order

    def warm_up(
        self,
        shapes: set[tuple[int, int, int]],
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
        cache_dtype: torch.dtype | None = None,
    ) -> None:
        compile_variants = self._kernels.warmup.compile_variants
        for num_heads, num_kv_heads, head_dim in sorted(shapes):
            compile_variants(num_heads, num_kv_heads, head_dim, block_size, dtype, device, cache_dtype)

    def prepare(self, batch: AttentionBatch) -> TritonAttentionMetadata:
        device = batch.slot_mapping.device
        query_lens = np.asarray(batch.query_lens, dtype=np.int64)
        host_seq_lens = np.asarray(batch.seq_lens, dtype=np.int64)
        block_tables = batch.block_tables.to(torch.int32)
        seq_lens = batch.seq_lens_tensor.to(torch.int32)
        decode_rows = np.flatnonzero(query_lens == 1)
        prefill_rows = np.flatnonzero(query_lens > 1)

        decode = None
        if decode_rows.size == batch.num_reqs:  # all decode: row i is token i, tables as they are
            decode = _DecodeRows(None, block_tables, seq_lens, int(host_seq_lens.max()))
        elif decode_rows.size:
            rows = to_device(decode_rows, device)
            token_index = batch.query_start_loc[rows].to(torch.int32)
            decode = _DecodeRows(token_index, block_tables[rows], seq_lens[rows], int(host_seq_lens[decode_rows].max()))
        tiles = None
        if prefill_rows.size:
            tiles = self._kernels.prefill.build_prefill_tiles(batch.query_lens, prefill_rows.tolist(), device)
        num_sms = self.num_sms if self.num_sms is not None else self._kernels.decode.device_sm_count(device)
        return TritonAttentionMetadata(
            batch.slot_mapping, decode, tiles, block_tables, batch.query_start_loc.to(torch.int32), seq_lens, num_sms
        )

    def decode_metadata(
        self, slot_mapping: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor, max_seq_len: int
    ) -> TritonAttentionMetadata:
        """Metadata for a pure decode step over caller-owned tensors (row i = token i), for CUDA-graph
        capture: the tensors' storage is what the graph reads on every replay, and max_seq_len (an
        upper bound, e.g. max_model_len) fixes the split-K count for the capture."""
        decode = _DecodeRows(None, block_tables, seq_lens, max_seq_len)
        rows = seq_lens.shape[0]
        query_start_loc = torch.arange(rows + 1, dtype=torch.int32, device=seq_lens.device)
        num_sms = self.num_sms if self.num_sms is not None else self._kernels.decode.device_sm_count(seq_lens.device)
        return TritonAttentionMetadata(slot_mapping, decode, None, block_tables, query_start_loc, seq_lens, num_sms)

    def tiled_metadata(
        self,
        slot_mapping: torch.Tensor,
        block_tables: torch.Tensor,
        query_start_loc: torch.Tensor,
        seq_lens: torch.Tensor,
        tile_req: torch.Tensor,
        tile_m0: torch.Tensor,
        block_m: int,
        decode_token_index: torch.Tensor,
        decode_seq_lens: torch.Tensor,
        max_seq_len: int,
    ) -> TritonAttentionMetadata:
        """Metadata for a mixed step over caller-owned tensors, for CUDA-graph capture, split like
        `prepare` splits it: every row runs through the decode kernel with its own query token
        (`decode_token_index`) and `decode_seq_lens` — the context length for one-token rows, 0 for
        the others, which only write zeros to a spare token — and the prefill kernel's fixed-length
        tile list covers the multi-token rows (unused tiles point at a row with no queries and no keys).
        max_seq_len fixes the decode split-K count for the capture."""
        from pagoda.kernels.attention.prefill import PrefillTiles  # lazy: triton (see _load_kernels)

        num_sms = self.num_sms if self.num_sms is not None else self._kernels.decode.device_sm_count(seq_lens.device)
        decode = _DecodeRows(decode_token_index, block_tables, decode_seq_lens, max_seq_len)
        return TritonAttentionMetadata(
            slot_mapping,
            decode,
            PrefillTiles(tile_req, tile_m0, block_m),
            block_tables,
            query_start_loc,
            seq_lens,
            num_sms,
        )

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        metadata: TritonAttentionMetadata,
        scale: float,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
    ) -> torch.Tensor:
        # q [T, Hq, D], k/v [T, Hkv, D] → out [T, Hq, D]; every token is a decode or a prefill row.
        self._kernels.store.store_kv(k, v, k_cache, v_cache, metadata.slot_mapping, k_scale, v_scale)
        return self._attend(q, k_cache, v_cache, metadata, scale, k.shape[1], k_scale, v_scale)

    def forward_rotary(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        metadata: TritonAttentionMetadata,
        scale: float,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
    ) -> torch.Tensor:
        """RoPE and the KV store in one launch (`rotary_store_kv`, `pagoda/kernels/rotary.py`) where the
        fused kernels run."""
        ops = dispatch.fused_for("rotary", q)
        cos, sin = cos_sin
        if ops is None or not ops.supports_rotary_store_kv(q, k, v, cos, sin, k_cache, v_cache):
            return super().forward_rotary(q, k, v, cos_sin, k_cache, v_cache, metadata, scale, k_scale, v_scale)
        q = ops.rotary_store_kv(q, k, v, cos, sin, k_cache, v_cache, metadata.slot_mapping, k_scale, v_scale)
        return self._attend(q, k_cache, v_cache, metadata, scale, k.shape[1], k_scale, v_scale)

    def _attend(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        metadata: TritonAttentionMetadata,
        scale: float,
        num_kv_heads: int,
        k_scale: float,
        v_scale: float,
    ) -> torch.Tensor:
        """Attention of q [T, Hq, D] over the cache, which already holds this step's keys and values."""
        kernels = self._kernels
        out = torch.empty_like(q)
        decode = metadata.decode
        if decode is not None:
            counters = self._split_counters.get(decode.num_rows, num_kv_heads, q.device)
            kernels.decode.paged_decode_attention(
                q,
                k_cache,
                v_cache,
                decode.block_tables,
                decode.seq_lens,
                scale,
                self._num_splits(decode, num_kv_heads, metadata.num_sms),
                k_scale=k_scale,
                v_scale=v_scale,
                query_index=decode.token_index,
                out=out,
                split_counters=counters,
            )
        if metadata.prefill_tiles is not None:
            kernels.prefill.paged_prefill_attention(
                q,
                k_cache,
                v_cache,
                metadata.block_tables,
                metadata.query_start_loc,
                metadata.seq_lens,
                scale,
                tiles=metadata.prefill_tiles,
                out=out,
                k_scale=k_scale,
                v_scale=v_scale,
            )
        return out

    def _num_splits(self, decode: _DecodeRows, num_kv_heads: int, num_sms: int) -> int:
        """Host arithmetic on prepare-time values only (no device reads)."""
        if self.decode_splits is not None:
            return self.decode_splits
        return self._kernels.decode.choose_num_splits(decode.num_rows, num_kv_heads, decode.max_seq_len, num_sms)


def select_attention_backend(device: str) -> AttentionBackend:
    """The Triton backend on CUDA devices when Triton is importable, else the PyTorch one."""
    if torch.device(device).type == "cuda":
        try:
            return TritonAttentionBackend()
        except ImportError:
            pass
    return TorchAttentionBackend()
