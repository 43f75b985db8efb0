"""Pure decode steps replayed as CUDA graphs, one graph per batch-size bucket.

Why: a 2B model's decode step launches ~1,700 kernels; launched from Python their host time is many
times the step's GPU work. A graph replays all of them for a small fraction of it
(`benchmarks/profile/decode_profile.py` shows the host and GPU time per step).

What is captured: for a bucket of `b` rows, the model forward over b tokens (one per row) plus the
LM head, reading every per-step input from static device buffers owned here:

    ints   int64 [9, N]  rows: token id | position | cache slot | context length | state slot |
                         snapshot block | M-RoPE t | h | w      (N = the largest bucket)
    tables int64 [N, max_blocks]  block table rows (columns past a row's length are never read)

A step of B <= N rows is written into a pinned host copy of `ints` (rows B..b-1 padded: context
length 0 makes attention return zeros, slot -1 stores no K/V, the state slot is the pool's scratch
slot, the snapshot block is the null block 0, which is never restored) and its rows' block tables
after it in the same flat buffer, copied in one transfer; then the smallest bucket b >= B is
replayed; logits rows [:B] are real.

Attention must be the Triton backend: its decode path has no host syncs and fixed launch shapes
once the split-K count is fixed (chosen at capture for the longest allowed context). Per-sequence
state (Yuan2's LF gate) and M-RoPE positions are inputs like any other, so they live inside the
graph too. Everything else — prefill and mixed steps, more than N rows — runs eagerly.

`capture=False` builds the same static-buffer path without capturing (each "replay" runs the forward
on the buffers): the CPU tests use it to check padding, scratch state and buffer layout.
"""

from __future__ import annotations

import gc
import logging
import time
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from pagoda.kernels import dispatch, policy
from pagoda.layers.attention import StepAttention
from pagoda.layers.sequence_state import SequenceStateBatch

logger = logging.getLogger(__name__)

_IDS, _POS, _SLOT, _SEQ_LEN, _STATE, _SNAPSHOT, _MROPE = 0, 1, 2, 3, 4, 5, 6
_PADDING = {_IDS: 0, _POS: 0, _SLOT: -1, _SEQ_LEN: 0, _SNAPSHOT: 0}  # _STATE: the scratch slot


def default_buckets(max_rows: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 8 up to max_rows (and max_rows itself): padding a step
    costs at most 7 rows of work beyond 8."""
    sizes = [b for b in (1, 2, 4) if b < max_rows] + list(range(8, max_rows, 8)) + [max_rows]
    return sorted(set(sizes))


def _capture_buckets(buckets: list[int], device: torch.device, attention, forward, what: str) -> dict:
    """Capture forward(b, attention(b)) for each bucket, largest first, in one memory pool (smaller
    graphs reuse the largest one's memory); two warm-up runs first compile the Triton kernels and
    pick cuBLAS algorithms. Returns {bucket: (graph, output tensor)}."""
    start = time.perf_counter()
    graphs = {}
    pool = torch.cuda.graph_pool_handle()
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    # No garbage collection inside a capture: a collected pinned host tensor (e.g. an earlier
    # engine's transfer buffer) makes the host allocator query its CUDA event, which is illegal
    # while a stream captures and invalidates the graph. So collect now, then not until the end.
    gc.collect()
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        with torch.inference_mode(), torch.cuda.stream(stream):
            for b in reversed(buckets):
                with dispatch.pdl_for_rows(b):  # compiled in the warm-up runs, baked in the graph
                    attn = attention(b)
                    for _ in range(2):
                        forward(b, attn)
                    stream.synchronize()
                    graph = torch.cuda.CUDAGraph()
                    # thread_local: another thread's CUDA calls (an API thread, a tokenizer pool) cannot
                    # invalidate this capture; this thread's own illegal calls still fail loudly.
                    with torch.cuda.graph(graph, pool=pool, stream=stream, capture_error_mode="thread_local"):
                        out = forward(b, attn)
                    graphs[b] = (graph, out)
    finally:
        if gc_was_enabled:
            gc.enable()
    torch.cuda.current_stream(device).wait_stream(stream)
    torch.cuda.synchronize(device)
    logger.info(
        "captured %d %s CUDA graphs (%d..%d) in %.1f s",
        len(graphs),
        what,
        buckets[0],
        buckets[-1],
        time.perf_counter() - start,
    )
    return graphs


def _launch(graphs: DecodeGraphs | StepGraphs, bucket: int, rows: int) -> torch.Tensor:
    """After a step's host→device copies: mark the host buffers reusable once they are done, then
    replay the bucket's graph (or run its forward uncaptured) and return the real rows' logits."""
    if graphs._copied is not None:
        graphs._copied.record()
    if graphs.capture:
        graph, logits = graphs.graphs[bucket]
        graph.replay()
        return logits[:rows]
    return graphs._forward(bucket, graphs._attention(bucket))[:rows]


@dataclass
class DecodeInputs:
    """One pure decode step, host side: B rows, one token each."""

    token_ids: np.ndarray  # [B] int64
    positions: np.ndarray  # [B] int64 (the token's position = tokens already cached)
    slots: np.ndarray  # [B] int64 cache slot of the new K/V
    block_tables: list[list[int]]  # [B] block ids per row
    state_slots: np.ndarray | None = None  # [B] (stateful models)
    mrope_positions: np.ndarray | None = None  # [3, B] (M-RoPE models)
    # (row index, token id) device tensors for rows whose token the host has not seen yet
    # (async scheduling: the previous step's sample); written over token_ids' placeholders.
    late_tokens: tuple[torch.Tensor, torch.Tensor] | None = None


class DecodeGraphs:
    def __init__(
        self,
        model: nn.Module,
        backend,
        max_rows: int,
        max_blocks_per_seq: int,
        block_size: int,
        max_seq_len: int,
        device: torch.device,
        scratch_slot: int | None,
        with_snapshots: bool,
        uses_mrope: bool,
        buckets: list[int] | None = None,
        capture: bool = True,
    ):
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
        # ints and tables are views of one flat buffer [ints | table rows], host and device alike, so a
        # step's inputs (ints and its rows' tables: a prefix) go over in one host-to-device copy.
        self._tables_at = 9 * n
        size = self._tables_at + n * max_blocks_per_seq
        self.host_all = torch.zeros(size, dtype=torch.int64, pin_memory=pin)
        self.host_ints = self.host_all[: self._tables_at].view(9, n)
        self.host_tables = self.host_all[self._tables_at :].view(n, max_blocks_per_seq)
        self._ints_np = self.host_ints.numpy()
        self._tables_np = self.host_tables.numpy()
        self.dev_all = torch.zeros(size, dtype=torch.int64, device=device)
        self.ints = self.dev_all[: self._tables_at].view(9, n)
        self.tables = self.dev_all[self._tables_at :].view(n, max_blocks_per_seq)
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
            state = SequenceStateBatch(
                ints[_STATE, :b],
                rows,
                rows,
                True,
                rows if self.with_snapshots else None,
                ints[_SNAPSHOT, :b] if self.with_snapshots else None,
                snapshot_every_row=True,
            )
        mrope = ints[_MROPE : _MROPE + 3, :b] if self.uses_mrope else None
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
        host[_MROPE : _MROPE + 3, start:] = 0

    # ---- capture ----------------------------------------------------------------------------
    def capture_all(self) -> None:
        """Capture every bucket, largest first (smaller graphs reuse its memory pool). Every row is
        padding while capturing, so the warm-up runs write no live KV, state or snapshot."""
        if self.capture:
            self.graphs = _capture_buckets(
                self.buckets, self.device, self._attention, self._forward, "decode (batch sizes)"
            )

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
            host[_MROPE : _MROPE + 3, :rows] = (
                inputs.mrope_positions if inputs.mrope_positions is not None else inputs.positions
            )
        self._pad(rows)
        for row, blocks in enumerate(inputs.block_tables):
            self._tables_np[row, : len(blocks)] = blocks
        end = self._tables_at + rows * self.tables.shape[1]
        self.dev_all[:end].copy_(self.host_all[:end], non_blocking=True)
        if inputs.late_tokens is not None:
            self.ints[_IDS].index_copy_(0, *inputs.late_tokens)
        return _launch(self, b, rows)


# ---- mixed steps (prefill chunks + decodes) -------------------------------------------------------


def default_token_buckets(max_tokens: int) -> list[int]:
    """Token-count buckets for mixed steps: fine steps where serving lives (a few new prompts among
    decodes), coarser above; capped at `policy.MIXED_GRAPH_MAX_TOKENS`."""
    steps = (16, 32, 64, 128, 256, 384, 512, 768, 1024, 1536, 2048)
    sizes = [b for b in steps if b <= policy.MIXED_GRAPH_MAX_TOKENS]
    top = next((b for b in sizes if b > max_tokens), sizes[-1])  # every step up to max_tokens fits
    return [b for b in sizes if b <= top]


@dataclass
class StepInputs:
    """One step of B rows and T tokens, host side (what the runner's eager path builds anyway)."""

    token_ids: np.ndarray  # [T]
    positions: np.ndarray  # [T]
    slots: np.ndarray  # [T]
    query_start_loc: np.ndarray  # [B + 1]
    seq_lens: np.ndarray  # [B]
    block_tables: np.ndarray  # [B, max_blocks] null-padded (the eager path's table)
    tile_req: np.ndarray  # [tiles] prefill-kernel tiles over all B rows
    tile_m0: np.ndarray  # [tiles]
    state_slots: np.ndarray | None = None  # [B]
    snapshot_tokens: np.ndarray | None = None  # [S] tokens that complete a KV block
    snapshot_blocks: np.ndarray | None = None  # [S]
    mrope_positions: np.ndarray | None = None  # [3, T]
    late_tokens: tuple[torch.Tensor, torch.Tensor] | None = None  # as in DecodeInputs (flat token index)


class StepGraphs:
    """Mixed steps (any rows, prefill chunks among decodes) as CUDA graphs, one per token bucket.

    Without them every step that admits a new prompt runs eagerly: ~1,000 launches from Python, whose
    host time at serving concurrency is paid every few steps and dominates TTFT (`benchmarks/h200.py`,
    PAGODA_MIXED_STEP_GRAPHS=0 against on).
    Attention is split as in the eager path: one-token rows through the decode kernel (every row is
    a decode row of the launch; the others have context 0 and write zeros to the spare token), the
    multi-token rows through the prefill kernel's tile list. Static shapes: T_b tokens (a step of T < T_b
    tokens; at least one token is spare, so padding rows can point at it), R = max_num_seqs + 1 rows (the last
    row is always padding: zero queries, zero keys, the scratch state slot), T_b/block_m + R tiles (the unused
    ones point at the padding row) and T_b/block_size + R snapshot entries (unused: the spare token
    into the null block). Logits come out for each row's last token; the runner keeps the rows
    that sample."""

    def __init__(
        self,
        model: nn.Module,
        backend,
        max_seqs: int,
        max_tokens: int,
        max_blocks_per_seq: int,
        block_size: int,
        block_m: int,
        device: torch.device,
        scratch_slot: int | None,
        with_snapshots: bool,
        uses_mrope: bool,
        buckets: list[int] | None = None,
        capture: bool = True,
        max_seq_len: int = 0,
    ):
        self.model, self.backend, self.device = model, backend, device
        self.max_seq_len = max_seq_len
        self.block_size, self.block_m = block_size, block_m
        self.scratch_slot, self.with_snapshots, self.uses_mrope = scratch_slot, with_snapshots, uses_mrope
        self.buckets = sorted(buckets or default_token_buckets(max_tokens))
        self.max_tokens = t = self.buckets[-1]
        self.rows = r = max_seqs + 1
        self.max_tiles = -(-t // block_m) + r
        self.max_snapshots = t // block_size + r
        pin = device.type == "cuda"
        shapes = {
            "tok": (6, t),
            "row": (6, r),
            "qsl": (r + 1,),
            "tiles": (2, self.max_tiles),
            "snap": (2, self.max_snapshots),
            "tables": (r, max_blocks_per_seq),
        }
        self.host = {k: torch.zeros(v, dtype=torch.int64, pin_memory=pin) for k, v in shapes.items()}
        self.np = {k: v.numpy() for k, v in self.host.items()}
        self.dev = {k: torch.zeros(v, dtype=torch.int64, device=device) for k, v in shapes.items()}
        self.capture = capture and device.type == "cuda"
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._copied = torch.cuda.Event() if device.type == "cuda" else None
        self._fill_padding(0, 0, t)
        for k in self.dev:
            self.dev[k].copy_(self.host[k])

    def bucket(self, tokens: int) -> int | None:
        """The smallest bucket with a spare token beyond `tokens`, or None (run eagerly)."""
        return next((b for b in self.buckets if b > tokens), None)

    def _attention(self, b: int) -> StepAttention:
        d = self.dev
        tiles = -(-b // self.block_m) + self.rows
        meta = self.backend.tiled_metadata(
            d["tok"][2, :b],
            d["tables"],
            d["qsl"],
            d["row"][0],
            d["tiles"][0, :tiles],
            d["tiles"][1, :tiles],
            self.block_m,
            d["row"][4],
            d["row"][5],
            self.max_seq_len,
        )
        state = None
        if self.scratch_slot is not None:
            snaps = b // self.block_size + self.rows
            state = SequenceStateBatch(
                d["row"][1],
                d["row"][2],
                d["row"][3],
                False,
                d["snap"][0, :snaps] if self.with_snapshots else None,
                d["snap"][1, :snaps] if self.with_snapshots else None,
            )
        mrope = d["tok"][3:6, :b] if self.uses_mrope else None
        return StepAttention(self.backend, meta, state, mrope_positions=mrope)

    def _forward(self, b: int, attn: StepAttention) -> torch.Tensor:
        d = self.dev
        hidden = self.model(d["tok"][0, :b], d["tok"][1, :b], attn)
        return self.model.compute_logits(hidden.index_select(0, d["row"][3]))

    def _fill_padding(self, tokens: int, rows: int, bucket: int) -> None:
        """Tokens [tokens, bucket) and rows [rows, R) become padding; `tokens` is the spare token."""
        n = self.np
        n["tok"][:, tokens:bucket] = 0
        n["tok"][2, tokens:bucket] = -1  # store no K/V
        n["row"][0, rows:] = 0  # no keys
        n["row"][1, rows:] = self.scratch_slot if self.scratch_slot is not None else 0
        n["row"][2:4, rows:] = tokens  # first/last token: the spare one
        n["row"][4, rows:] = tokens  # decode query: the spare token
        n["row"][5, rows:] = 0  # decode context: none
        n["qsl"][rows:] = tokens  # no queries

    def capture_all(self) -> None:
        if not self.capture:
            return
        self._fill_padding(0, 0, self.max_tokens)
        tiles, snaps = self.np["tiles"], self.np["snap"]
        tiles[0], tiles[1] = self.rows - 1, 0
        snaps[0], snaps[1] = 0, 0
        for k in self.dev:
            self.dev[k].copy_(self.host[k])
        self.graphs = _capture_buckets(self.buckets, self.device, self._attention, self._forward, "mixed-step (tokens)")

    @torch.inference_mode()
    def run(self, inputs: StepInputs) -> torch.Tensor:
        """Logits [B, V] for each row's last token this step."""
        t, rows = len(inputs.token_ids), len(inputs.seq_lens)
        b = self.bucket(t)
        if self._copied is not None:
            self._copied.synchronize()
        n = self.np
        n["tok"][0, :t] = inputs.token_ids
        n["tok"][1, :t] = inputs.positions
        n["tok"][2, :t] = inputs.slots
        if self.uses_mrope:
            n["tok"][3:6, :t] = inputs.mrope_positions if inputs.mrope_positions is not None else inputs.positions
        n["row"][0, :rows] = inputs.seq_lens
        if self.scratch_slot is not None:
            n["row"][1, :rows] = inputs.state_slots
        n["row"][2, :rows] = inputs.query_start_loc[:-1]
        n["row"][3, :rows] = inputs.query_start_loc[1:] - 1
        n["qsl"][: rows + 1] = inputs.query_start_loc
        one = np.diff(inputs.query_start_loc) == 1
        n["row"][4, :rows] = np.where(one, inputs.query_start_loc[1:] - 1, t)
        n["row"][5, :rows] = np.where(one, inputs.seq_lens, 0)
        self._fill_padding(t, rows, b)
        tiles = len(inputs.tile_req)
        n["tiles"][0, :tiles] = inputs.tile_req
        n["tiles"][1, :tiles] = inputs.tile_m0
        n["tiles"][0, tiles:] = self.rows - 1
        n["tiles"][1, tiles:] = 0
        if self.with_snapshots and self.scratch_slot is not None:
            s = 0 if inputs.snapshot_tokens is None else len(inputs.snapshot_tokens)
            if s:
                n["snap"][0, :s] = inputs.snapshot_tokens
                n["snap"][1, :s] = inputs.snapshot_blocks
            n["snap"][0, s:] = t
            n["snap"][1, s:] = 0
        n["tables"][:rows, : inputs.block_tables.shape[1]] = inputs.block_tables
        for k in ("tok", "row", "qsl", "tiles", "snap"):
            self.dev[k].copy_(self.host[k], non_blocking=True)
        self.dev["tables"][:rows].copy_(self.host["tables"][:rows], non_blocking=True)
        if inputs.late_tokens is not None:
            self.dev["tok"][0].index_copy_(0, *inputs.late_tokens)
        return _launch(self, b, rows)
