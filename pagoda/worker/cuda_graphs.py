"""Pure decode steps replayed as CUDA graphs, one graph per batch-size bucket.

Why: a 2B model's decode step launches ~1,700 kernels; launched from Python that costs ~20 ms of
host time per step against ~1-3 ms of GPU work. A graph replays all of them for ~0.1 ms of host.

What is captured: for a bucket of `b` rows, the model forward over b tokens (one per row) plus the
LM head, reading every per-step input from static device buffers owned here:

    ints   int64 [9, N]  rows: token id | position | cache slot | context length | state slot |
                         snapshot block | M-RoPE t | h | w      (N = the largest bucket)
    tables int64 [N, max_blocks]  block table rows (columns past a row's length are never read)

A step of B <= N rows is written into a pinned host copy of `ints` (rows B..b-1 padded: context
length 0 makes attention return zeros, slot -1 stores no K/V, the state slot is the pool's scratch
slot, the snapshot block is the null block 0, which is never restored), copied in one transfer, the
block tables in a second, then the smallest bucket b >= B is replayed; logits rows [:B] are real.

Attention must be the Triton backend: its decode path has no host syncs and fixed launch shapes
once the split-K count is fixed (chosen at capture for the longest allowed context). Per-sequence
state (Yuan2's LF gate) and M-RoPE positions are inputs like any other, so they live inside the
graph too. Everything else — prefill and mixed steps, more than N rows — runs eagerly.

`capture=False` builds the same static-buffer path without capturing (each "replay" runs the forward
on the buffers): the CPU tests use it to check padding, scratch state and buffer layout.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from pagoda.layers.attention import StepAttention
from pagoda.layers.sequence_state import SequenceStateBatch

logger = logging.getLogger(__name__)

_IDS, _POS, _SLOT, _SEQ_LEN, _STATE, _SNAPSHOT, _MROPE = 0, 1, 2, 3, 4, 5, 6
_PADDING = {_IDS: 0, _POS: 0, _SLOT: -1, _SEQ_LEN: 0, _SNAPSHOT: 0}   # _STATE: the scratch slot


def default_buckets(max_rows: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 8 up to max_rows (and max_rows itself): padding a step
    costs at most 7 rows of work beyond 8."""
    sizes = [b for b in (1, 2, 4) if b < max_rows] + list(range(8, max_rows, 8)) + [max_rows]
    return sorted(set(sizes))


@dataclass
class DecodeInputs:
    """One pure decode step, host side: B rows, one token each."""

    token_ids: np.ndarray        # [B] int64
    positions: np.ndarray        # [B] int64 (the token's position = tokens already cached)
    slots: np.ndarray            # [B] int64 cache slot of the new K/V
    block_tables: list[list[int]]  # [B] block ids per row
    state_slots: np.ndarray | None = None     # [B] (stateful models)
    mrope_positions: np.ndarray | None = None  # [3, B] (M-RoPE models)


class DecodeGraphs:
    def __init__(self, model: nn.Module, backend, max_rows: int, max_blocks_per_seq: int, block_size: int,
                 max_seq_len: int, device: torch.device, scratch_slot: int | None, with_snapshots: bool,
                 uses_mrope: bool, buckets: list[int] | None = None, capture: bool = True):
        self.model = model
        self.backend = backend
        self.block_size = block_size
        self.max_seq_len = max_seq_len
        self.device = device
        self.scratch_slot = scratch_slot
        self.with_snapshots = with_snapshots
        self.uses_mrope = uses_mrope
        self.buckets = sorted(buckets or default_buckets(max_rows))
        self.max_rows = n = self.buckets[-1]
        pin = device.type == "cuda"
        self.host_ints = torch.zeros(9, n, dtype=torch.int64, pin_memory=pin)
        self.host_tables = torch.zeros(n, max_blocks_per_seq, dtype=torch.int64, pin_memory=pin)
        self._ints_np = self.host_ints.numpy()
        self._tables_np = self.host_tables.numpy()
        self.ints = torch.zeros(9, n, dtype=torch.int64, device=device)
        self.tables = torch.zeros(n, max_blocks_per_seq, dtype=torch.int64, device=device)
        self.rows = torch.arange(n, dtype=torch.int64, device=device)
        self._pad(0)
        self.ints.copy_(self.host_ints)
        self.capture = capture and device.type == "cuda"
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        # The host buffers are rewritten each step: wait until the last step's copies have left them.
        self._copied = torch.cuda.Event() if device.type == "cuda" else None

    # ---- static views -----------------------------------------------------------------------
    def _attention(self, b: int) -> StepAttention:
        ints = self.ints
        meta = self.backend.decode_metadata(ints[_SLOT, :b], self.tables[:b], ints[_SEQ_LEN, :b], self.max_seq_len)
        state = None
        if self.scratch_slot is not None:
            rows = self.rows[:b]
            state = SequenceStateBatch(ints[_STATE, :b], rows, rows, True,
                                       rows if self.with_snapshots else None,
                                       ints[_SNAPSHOT, :b] if self.with_snapshots else None)
        mrope = ints[_MROPE:_MROPE + 3, :b] if self.uses_mrope else None
        return StepAttention(self.backend, meta, state, mrope_positions=mrope)

    def _forward(self, b: int, attn: StepAttention) -> torch.Tensor:
        hidden = self.model(self.ints[_IDS, :b], self.ints[_POS, :b], attn)
        return self.model.compute_logits(hidden)

    def _pad(self, start: int) -> None:
        """Rows [start, N) of the host buffer become padding rows."""
        host = self._ints_np
        for row, value in _PADDING.items():
            host[row, start:] = value
        host[_STATE, start:] = self.scratch_slot if self.scratch_slot is not None else 0
        host[_MROPE:_MROPE + 3, start:] = 0

    # ---- capture ----------------------------------------------------------------------------
    def capture_all(self) -> None:
        """Capture every bucket, largest first (smaller graphs reuse its memory pool). Every row is
        padding while capturing, so the warm-up runs write no live KV, state or snapshot."""
        if not self.capture:
            return
        start = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.inference_mode(), torch.cuda.stream(stream):
            for b in reversed(self.buckets):
                attn = self._attention(b)
                for _ in range(2):                 # compile Triton kernels, pick cuBLAS algorithms
                    self._forward(b, attn)
                stream.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    logits = self._forward(b, attn)
                self.graphs[b] = (graph, logits)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        torch.cuda.synchronize(self.device)
        logger.info("captured %d decode CUDA graphs (batch sizes %d..%d) in %.1f s", len(self.graphs),
                    self.buckets[0], self.buckets[-1], time.perf_counter() - start)

    # ---- one step ---------------------------------------------------------------------------
    def bucket(self, rows: int) -> int | None:
        """The smallest bucket holding `rows`, or None when the step is too large for a graph."""
        if rows > self.max_rows:
            return None
        return next(b for b in self.buckets if b >= rows)

    @torch.inference_mode()
    def run(self, inputs: DecodeInputs) -> torch.Tensor:
        """Logits [B, V] of one pure decode step (B = len(inputs.token_ids) <= max_rows)."""
        rows = len(inputs.token_ids)
        b = self.bucket(rows)
        if self._copied is not None:
            self._copied.synchronize()
        host = self._ints_np
        host[_IDS, :rows] = inputs.token_ids
        host[_POS, :rows] = inputs.positions
        host[_SLOT, :rows] = inputs.slots
        host[_SEQ_LEN, :rows] = inputs.positions + 1
        if self.scratch_slot is not None:
            host[_STATE, :rows] = inputs.state_slots
            if self.with_snapshots:
                # A token that fills the last slot of its block writes that block's snapshot; the
                # others write into the null block's snapshot, which is never read.
                ends = inputs.positions % self.block_size == self.block_size - 1
                host[_SNAPSHOT, :rows] = np.where(ends, inputs.slots // self.block_size, 0)
        if self.uses_mrope:
            host[_MROPE:_MROPE + 3, :rows] = (inputs.mrope_positions if inputs.mrope_positions is not None
                                              else inputs.positions)
        self._pad(rows)
        for row, blocks in enumerate(inputs.block_tables):
            self._tables_np[row, :len(blocks)] = blocks
        self.ints.copy_(self.host_ints, non_blocking=True)
        self.tables[:rows].copy_(self.host_tables[:rows], non_blocking=True)
        if self._copied is not None:
            self._copied.record()
        if self.capture:
            graph, logits = self.graphs[b]
            graph.replay()
            return logits[:rows]
        return self._forward(b, self._attention(b))[:rows]
