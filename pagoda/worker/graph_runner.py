"""Steps replayed as CUDA graphs: one runner, one static buffer layout, graphs per bucket.

Why: a 2B model's decode step launches ~1,700 kernels; launched from Python their host time is many
times the step's GPU work. A graph replays all of them for a small fraction of it
(`benchmarks/profile/decode_profile.py` shows the host and GPU time per step). Steps that admit a
prompt (prefill chunks among decodes) launch ~1,000 and come every few steps at serving concurrency,
so they have graphs too (`benchmarks/h200.py` serve TTFT, PAGODA_MIXED_STEP_GRAPHS=0 against on).

Two kinds of bucket share the buffers:
- decode buckets (rows == tokens, b rows): every row has one token; attention through the decode
  kernel alone (`decode_metadata`), logits for all b rows;
- mixed buckets (b tokens, any rows): one-token rows through the decode kernel (every row is a
  decode row of that launch; the others have context 0 and write zeros to the spare token), the
  multi-token rows through the prefill kernel's tile list (`tiled_metadata`); a step of t < b tokens
  (at least one spare token, so padding rows can point at it) over R = max_rows + 1 rows (the last
  row is always padding). The graph ends at the hidden states [b, H]: the logits are taken after the
  replay at the positions the step asks for (each sampling row's last token, or a speculative row's
  last 1 + d tokens), so verification steps replay the same graphs and no step computes logits for
  rows that do not sample.

A verification step whose every token is verified (no prefill chunk beside it), of a model without
per-sequence state, replays a decode bucket instead: each token is a decode row of its own, its context
ending at itself (`_tokens_as_rows`; PAGODA_SPEC_DECODE_ROWS=0 keeps it on a mixed bucket).

A model with a vision encoder (on the first pipeline stage) runs the encoder eagerly, then replays
a mixed bucket whose embedding rows at the step's placeholder tokens come from a static buffer
[T, H]: `mm` holds each placeholder token's index, the rest of the bucket's entries its last token
(always padding in a mixed bucket), so one fixed-size index_copy serves any number of placeholders.
Why: at one image per step the language model's ~1,000 launches were half of an eager image step.

Every per-step input lives in one flat int64 buffer (pinned on the host, mirrored on the device, one
host-to-device copy per step: the fixed sections, then the step's rows of block tables):

    tok    [6, T]   token id | position | cache slot | M-RoPE t | h | w
    row    [6, R]   context length | state slot | first token | last token | decode token | decode context
    snap   [2, S]   token | block of each state snapshot written (decode buckets: one per row, block 0
                    when the row does not end a block; mixed buckets with speculation: also the state
                    kept at each position of a verification row, `StepInputs.state_writes`)
    qsl    [R + 1]  each row's first token (mixed buckets)
    tiles  [2, K]   prefill tile: row | first query (mixed buckets)
    mm     [T]      the token each encoder row of `mm_rows` replaces (mixed buckets, models with an encoder)
    tables [R, max_blocks]

Padding: token id 0, position 0, slot -1 (stores no K/V), context length 0 (attention returns
zeros), the state pool's scratch slot, snapshots into the null block 0 (never restored), unused tiles
on the last padding row (zero queries). Attention must be the Triton backend: fixed launch shapes, no
host syncs, the split-K count fixed at capture for the longest allowed context.

`capture=False` runs the same buffers eagerly (each "replay" runs the forward): the CPU tests check
padding, scratch state and layout through it.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import torch
from torch import nn

from pagoda import envs
from pagoda.config import EngineConfig
from pagoda.device_copy import to_device
from pagoda.kernels import dispatch, policy
from pagoda.layers.attention import StepAttention
from pagoda.layers.pipeline import StageHidden
from pagoda.layers.sequence_state import SequenceStateBatch, snapshot_pairs
from pagoda.worker.pipeline_link import PipelineLink
from pagoda.worker.step_inputs import StepInputs

T = TypeVar("T")

logger = logging.getLogger(__name__)

DECODE, MIXED = "decode", "mixed"
SPEC_DECODE_ROWS = envs.SPEC_DECODE_ROWS.value  # read once: the switch is set before the process starts
# Mixed-step token buckets: fine where serving lives (a few new prompts among decodes), coarser above;
# capped at `policy.MIXED_GRAPH_MAX_TOKENS`.
_TOKEN_STEPS = (16, 32, 64, 128, 256, 384, 512, 768, 1024, 1536, 2048)


# ---- bucket policy (pure) -------------------------------------------------------------------------
def default_buckets(max_rows: int) -> list[int]:
    """Decode buckets: 1, 2, 4, 8, then every multiple of 8 up to max_rows (and max_rows itself):
    padding a step costs at most 7 rows of work beyond 8."""
    sizes = [b for b in (1, 2, 4) if b < max_rows] + list(range(8, max_rows, 8)) + [max_rows]
    return sorted(set(sizes))


def default_token_buckets(max_tokens: int) -> list[int]:
    """Mixed-step token buckets: every step up to max_tokens fits (each bucket keeps a spare token)."""
    sizes = [b for b in _TOKEN_STEPS if b <= policy.MIXED_GRAPH_MAX_TOKENS]
    top = next((b for b in sizes if b > max_tokens), sizes[-1])
    return [b for b in sizes if b <= top]


def capture_buckets(
    max_num_seqs: int, max_num_batched_tokens: int, max_capture_size: int | None, mixed: bool
) -> tuple[list[int], list[int]]:
    """(decode buckets, mixed token buckets) to capture. `max_capture_size` (None: no cap) bounds
    both: decode steps of more rows, and mixed steps needing a bucket of more tokens, run eagerly."""
    cap = max_num_seqs if max_capture_size is None else min(max_num_seqs, max_capture_size)
    tokens = default_token_buckets(max_num_batched_tokens) if mixed else []
    if max_capture_size is not None:
        tokens = [b for b in tokens if b <= max_capture_size]
    return default_buckets(cap), tokens


@dataclass(frozen=True)
class GraphSpec:
    """What a graph runner captures; its buffer sizes follow from it."""

    decode_buckets: tuple[int, ...]  # rows, ascending (may be empty)
    token_buckets: tuple[int, ...]  # tokens of mixed steps, ascending (empty: mixed steps run eagerly)
    max_rows: int  # rows a step can have (max_num_seqs)
    max_blocks_per_seq: int
    block_size: int
    block_m: int  # the prefill kernel's query tile height
    max_seq_len: int  # the longest context (fixes the decode kernel's split-K count at capture)
    scratch_slot: int | None  # the state pool's padding slot; None: the model keeps no per-sequence state
    with_snapshots: bool  # state snapshots per KV block (stateful model with prefix caching)
    uses_mrope: bool
    spec_states: bool = False  # a stateful model's verification steps keep a state per position (speculation)
    mm_rows: tuple[int, torch.dtype] | None = None  # (width, dtype) of encoder rows a mixed step takes in

    @classmethod
    def create(
        cls,
        config: EngineConfig,
        scratch_slot: int | None,
        with_snapshots: bool,
        uses_mrope: bool,
        decode_buckets: list[int] | None = None,
        token_buckets: list[int] | None = None,
        mm_rows: tuple[int, torch.dtype] | None = None,
    ) -> GraphSpec:
        """The engine's spec: buckets from its limits (or the ones given, for tests)."""
        sched = config.scheduler
        decode, tokens = capture_buckets(
            sched.max_num_seqs,
            sched.max_num_batched_tokens,
            config.device.max_cudagraph_capture_size,
            envs.MIXED_STEP_GRAPHS.value,  # A/B switch: mixed steps eager
        )
        return cls(
            decode_buckets=tuple(sorted(decode_buckets or decode)),
            token_buckets=tuple(sorted(token_buckets or tokens)) if tokens else (),
            max_rows=sched.max_num_seqs,
            max_blocks_per_seq=-(-config.model.max_model_len // config.cache.block_size),
            block_size=config.cache.block_size,
            block_m=prefill_tile_height(),
            max_seq_len=config.model.max_model_len,
            scratch_slot=scratch_slot,
            with_snapshots=with_snapshots,
            uses_mrope=uses_mrope,
            spec_states=scratch_slot is not None and sched.speculative is not None,
            mm_rows=mm_rows,
        )

    @property
    def num_tokens(self) -> int:  # T
        return max(self.decode_buckets[-1:] + self.token_buckets[-1:], default=1)

    @property
    def num_rows(self) -> int:  # R: one more than any step has (the always-padding row)
        return max((self.max_rows, *self.decode_buckets[-1:])) + 1

    def num_tiles(self, tokens: int) -> int:
        return -(-tokens // self.block_m) + self.num_rows

    def num_snapshots(self, tokens: int) -> int:
        return tokens // self.block_size + self.num_rows + (tokens if self.spec_states else 0)

    def bucket_for(self, num_rows: int, num_tokens: int, needs_encoder: bool) -> tuple[str, int] | None:
        """(kind, size) of the graph a step replays, or None (it runs eagerly): a pure decode step
        takes the smallest decode bucket holding its rows, else the smallest token bucket with a
        spare token; a step that runs the vision encoder takes a token bucket, where the spec has room
        for encoder rows (`mm_rows`), else runs eagerly."""
        if needs_encoder and self.mm_rows is None:
            return None
        decode = num_tokens == num_rows and not needs_encoder
        if decode and self.decode_buckets and num_rows <= self.decode_buckets[-1]:
            return DECODE, next(b for b in self.decode_buckets if b >= num_rows)
        size = next((b for b in self.token_buckets if b > num_tokens), None)
        return None if size is None else (MIXED, size)


# ---- the runner ---------------------------------------------------------------------------------
class GraphRunner:
    def __init__(
        self,
        spec: GraphSpec,
        model: nn.Module,
        backend,
        device: torch.device,
        capture: bool = True,
        link: PipelineLink | None = None,
    ):
        self.spec, self.model, self.backend, self.device = spec, model, backend, device
        # Pipeline parallelism: a stage after the first starts from the previous stage's activations, received
        # into static buffers [2, T, H] the graphs read; a stage before the last returns its own (StageHidden).
        self.link = link
        first = link is None or link.stage.first
        self.stage_in = None
        if not first:
            self.stage_in = torch.zeros(2, spec.num_tokens, link.hidden_size, dtype=link.dtype, device=device)
        t, r, mb = spec.num_tokens, spec.num_rows, spec.max_blocks_per_seq
        mm_rows = spec.mm_rows if first else None  # encoder rows: the first stage only (the others bucket alike)
        shapes = {
            "tok": (6, t),
            "row": (6, r),
            "snap": (2, spec.num_snapshots(t)),
            "qsl": (r + 1,),
            "tiles": (2, spec.num_tiles(t)),
            "mm": (t if mm_rows is not None else 0,),
            "tables": (r, mb),
        }
        pin = device.type == "cuda"
        size = sum(int(np.prod(s)) for s in shapes.values())
        self._host_all = torch.zeros(size, dtype=torch.int64, pin_memory=pin)
        self._dev_all = torch.zeros(size, dtype=torch.int64, device=device)
        self.host, self.dev, at = {}, {}, 0
        for name, shape in shapes.items():
            n = int(np.prod(shape))
            self.host[name] = self._host_all[at : at + n].view(shape).numpy()
            self.dev[name] = self._dev_all[at : at + n].view(shape)
            at += n
        self._tables_at = size - r * mb
        self._rows = torch.arange(r, dtype=torch.int64, device=device)
        self.mm_rows = None
        if mm_rows is not None:  # zeros: a padding token's row stays finite whatever it is given
            width, dtype = mm_rows
            self.mm_rows = torch.zeros(t, width, dtype=dtype, device=device)
        self.capture = capture and device.type == "cuda"
        self.graphs: dict[tuple[str, int], tuple[torch.cuda.CUDAGraph, torch.Tensor | StageHidden]] = {}
        # The host buffer is rewritten each step: wait until the last step's copy has left it.
        self._copied = torch.cuda.Event() if device.type == "cuda" else None
        self._pad_all()

    def can_run(self, inputs: StepInputs) -> bool:
        return self.bucket_for(inputs) is not None

    def bucket_for(self, inputs: StepInputs) -> tuple[str, int] | None:
        rows = inputs.num_tokens if self._tokens_as_rows(inputs) else inputs.num_rows
        return self.spec.bucket_for(rows, inputs.num_tokens, inputs.needs_encoder)

    def _tokens_as_rows(self, x: StepInputs) -> bool:
        """A step whose tokens can run as decode rows (`StepInputs.tokens_as_rows`) replays a decode bucket. A
        mixed bucket's decode kernel spans every row the engine may have and its prefill tiles the rest, which
        costs a small model's one-request verification several times a decode step's GPU time."""
        return SPEC_DECODE_ROWS and x.tokens_as_rows

    @torch.inference_mode()
    def run(
        self, inputs: StepInputs, positions: np.ndarray, mm: tuple[np.ndarray, torch.Tensor] | None = None
    ) -> torch.Tensor | StageHidden:
        """Logits [len(positions), V] at those token indices of the step (`can_run(inputs)` must hold); on a
        pipeline stage before the last, its activations over the whole bucket. `mm`: the encoder's (flat token
        indices [P], rows [P, H]) for the step's placeholder tokens."""
        kind, b = self.bucket_for(inputs)
        if self._copied is not None:
            self._copied.synchronize()
        rows = self.write(inputs, kind, b)
        if self.mm_rows is not None and kind == MIXED:
            self._write_mm(mm, b)
        end = self._tables_at + rows * self.spec.max_blocks_per_seq
        self._dev_all[:end].copy_(self._host_all[:end], non_blocking=True)
        if inputs.late_tokens is not None:
            self.dev["tok"][0].index_copy_(0, *inputs.late_tokens)
        if self._copied is not None:
            self._copied.record()
        if self.stage_in is not None:
            self.link.receive_into(self.stage_in[:, :b])
        if self.capture:
            graph, out = self.graphs[kind, b]
            graph.replay()
        else:
            out = self._forward(kind, b, self._attention(kind, b))
        if isinstance(out, StageHidden):
            return out
        n = len(positions)
        if kind == DECODE:  # a decode bucket's output is already every row's logits (a row is a token)
            every_row = n == rows and (n == 0 or positions[-1] == n - 1)
            return out[:n] if every_row else out[to_device(positions, out.device)]
        return self.model.compute_logits(out.index_select(0, to_device(positions, out.device)))

    # ---- host buffers -----------------------------------------------------------------------
    def write(self, x: StepInputs, kind: str, b: int) -> int:
        """The step into the host buffer, everything the bucket reads past it as padding. Returns the rows
        written (a verification step in a decode bucket: one per token, `_tokens_as_rows`)."""
        spec, h = self.spec, self.host
        t, rows = x.num_tokens, x.num_rows
        tok, row = h["tok"], h["row"]
        tok[0, :t], tok[1, :t], tok[2, :t] = x.token_ids, x.positions, x.slots
        if spec.uses_mrope:
            tok[3:6, :t] = x.mrope_positions if x.mrope_positions is not None else x.positions
        width = x.block_tables.shape[1]
        if kind == DECODE and rows < t:  # each token a row: its context ends at itself, its request's table
            row[0, :t] = x.positions + 1
            h["tables"][:t, :width] = np.repeat(x.block_tables, x.query_lens, axis=0)
            rows = t
        else:
            row[0, :rows] = x.seq_lens
            if spec.scratch_slot is not None:
                row[1, :rows] = x.state_slots
            h["tables"][:rows, :width] = x.block_tables
        if kind == DECODE:
            self._pad(t, rows, b, b)
            if spec.with_snapshots:
                # A token that fills the last slot of its block writes that block's snapshot; the
                # others write into the null block's snapshot, which is never read.
                ends = x.positions % spec.block_size == spec.block_size - 1
                h["snap"][1, :rows] = np.where(ends, x.slots // spec.block_size, 0)
                h["snap"][1, rows:b] = 0
            return rows
        qsl = x.query_start_loc
        self._pad(t, rows, b, spec.num_rows)
        row[2, :rows], row[3, :rows] = qsl[:-1], qsl[1:] - 1
        one = np.diff(qsl) == 1
        row[4, :rows] = np.where(one, qsl[1:] - 1, t)
        row[5, :rows] = np.where(one, x.seq_lens, 0)
        h["qsl"][: rows + 1] = qsl
        req, m0 = _tile_arrays(x.query_lens, spec.block_m)
        self._set_pairs("tiles", req, m0, spec.num_rows - 1, 0)
        if spec.with_snapshots or spec.spec_states:
            ends, entries = snapshot_pairs(x.positions, x.slots, spec.block_size, spec.with_snapshots, x.state_writes)
            self._set_pairs("snap", ends, entries, t, 0)
        return rows

    def _write_mm(self, mm: tuple[np.ndarray, torch.Tensor] | None, b: int) -> None:
        """The step's encoder rows into `mm_rows` (queued on the device) and their tokens into the host's `mm`;
        the bucket's other entries name its last token, a padding one."""
        index, p = self.host["mm"], 0
        if mm is not None:
            p = len(mm[0])
            index[:p] = mm[0]
            self.mm_rows[:p].copy_(mm[1], non_blocking=True)
        index[p:b] = b - 1

    def _pad(self, tokens: int, rows: int, token_end: int, row_end: int) -> None:
        """Tokens [tokens, token_end) and rows [rows, row_end) become padding; `tokens` is the spare
        token that padding rows of a mixed bucket point at."""
        tok, row = self.host["tok"], self.host["row"]
        tok[:, tokens:token_end] = 0
        tok[2, tokens:token_end] = -1  # store no K/V
        row[0, rows:row_end] = 0  # no keys
        row[1, rows:row_end] = self.spec.scratch_slot if self.spec.scratch_slot is not None else 0
        row[2:5, rows:row_end] = tokens  # first, last and decode token: the spare one
        row[5, rows:row_end] = 0  # decode context: none
        self.host["qsl"][rows:] = tokens  # no queries

    def _set_pairs(self, name: str, first: np.ndarray, second: np.ndarray, pad_first: int, pad_second: int) -> None:
        buf, n = self.host[name], len(first)
        buf[0, :n], buf[1, :n] = first, second
        buf[0, n:], buf[1, n:] = pad_first, pad_second

    def _pad_all(self) -> None:
        """Every token and row padding (as while capturing: the warm-up runs then write no live KV,
        state or snapshot), copied to the device."""
        self._pad(0, 0, self.spec.num_tokens, self.spec.num_rows)
        self._set_pairs("tiles", _NONE, _NONE, self.spec.num_rows - 1, 0)
        self._set_pairs("snap", _NONE, _NONE, 0, 0)
        self.host["mm"][:] = 0  # while capturing every token is padding
        self._dev_all.copy_(self._host_all)

    # ---- static views -----------------------------------------------------------------------
    def _attention(self, kind: str, b: int) -> StepAttention:
        spec, d = self.spec, self.dev
        mrope = d["tok"][3:6, :b] if spec.uses_mrope else None
        if kind == DECODE:
            meta = self.backend.decode_metadata(d["tok"][2, :b], d["tables"][:b], d["row"][0, :b], spec.max_seq_len)
            state = None
            if spec.scratch_slot is not None:
                rows = self._rows[:b]
                snaps = spec.with_snapshots
                state = SequenceStateBatch(
                    d["row"][1, :b],
                    rows,
                    rows,
                    True,
                    rows if snaps else None,
                    d["snap"][1, :b] if snaps else None,
                    snapshot_every_row=True,
                )
            return self._with_stage_input(StepAttention(self.backend, meta, state, mrope_positions=mrope), b)
        tiles = spec.num_tiles(b)
        meta = self.backend.tiled_metadata(
            d["tok"][2, :b],
            d["tables"],
            d["qsl"],
            d["row"][0],
            d["tiles"][0, :tiles],
            d["tiles"][1, :tiles],
            spec.block_m,
            d["row"][4],
            d["row"][5],
            spec.max_seq_len,
        )
        state = None
        if spec.scratch_slot is not None:
            snaps = spec.num_snapshots(b)
            with_snaps = spec.with_snapshots or spec.spec_states
            state = SequenceStateBatch(
                d["row"][1],
                d["row"][2],
                d["row"][3],
                False,
                d["snap"][0, :snaps] if with_snaps else None,
                d["snap"][1, :snaps] if with_snaps else None,
            )
        attn = StepAttention(self.backend, meta, state, mrope_positions=mrope)
        if self.mm_rows is not None:
            attn.mm_embeds = d["mm"][:b], self.mm_rows[:b]
        return self._with_stage_input(attn, b)

    def _with_stage_input(self, attn: StepAttention, b: int) -> StepAttention:
        if self.stage_in is not None:
            attn.stage_input = (self.stage_in[0, :b], self.stage_in[1, :b])
        return attn

    def _forward(self, kind: str, b: int, attn: StepAttention) -> torch.Tensor | StageHidden:
        tok = self.dev["tok"]
        hidden = self.model(tok[0, :b], tok[1, :b], attn)
        if isinstance(hidden, StageHidden) or kind == MIXED:
            return hidden
        return self.model.compute_logits(hidden)

    # ---- capture ----------------------------------------------------------------------------
    def capture_all(self) -> None:
        """Capture every bucket, decode buckets first; each kind largest first in one memory pool."""
        if not self.capture:
            return
        for kind, buckets, what in (
            (DECODE, self.spec.decode_buckets, "decode (batch sizes)"),
            (MIXED, self.spec.token_buckets, "mixed-step (tokens)"),
        ):
            if buckets:
                self._pad_all()
                graphs = _capture_buckets(
                    list(buckets),
                    self.device,
                    lambda b, k=kind: self._attention(k, b),
                    lambda b, attn, k=kind: self._forward(k, b, attn),
                    what,
                )
                self.graphs.update({(kind, b): g for b, g in graphs.items()})


_NONE = np.zeros(0, dtype=np.int64)


def prefill_tile_height() -> int:
    """The prefill kernel's query tile height, which a mixed bucket's tile list is cut by."""
    from pagoda.kernels.attention.prefill import prefill_block_m  # lazy: triton (fixes TRITON_INTERPRET mode)

    return prefill_block_m()


def _tile_arrays(query_lens: np.ndarray, block_m: int) -> tuple[np.ndarray, np.ndarray]:
    """Prefill-kernel tiles over the multi-token rows (one-token rows go through the decode kernel)."""
    from pagoda.kernels.attention.prefill import prefill_tile_arrays  # lazy: triton (fixes TRITON_INTERPRET mode)

    lens = query_lens.tolist()
    return prefill_tile_arrays(lens, [i for i, n in enumerate(lens) if n > 1], block_m)


def _capture_buckets(
    buckets: list[int],
    device: torch.device,
    attention: Callable[[int], StepAttention],
    forward: Callable[[int, StepAttention], torch.Tensor | StageHidden],
    what: str,
) -> dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor | StageHidden]]:
    """Capture forward(b, attention(b)) for each bucket, largest first, in one memory pool (smaller
    graphs reuse the largest one's memory); two warm-up runs first compile the Triton kernels and
    pick cuBLAS algorithms. Returns {bucket: (graph, output tensor)}."""
    start = time.perf_counter()
    graphs = {}
    pool = torch.cuda.graph_pool_handle()
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with gc_paused(), torch.inference_mode(), torch.cuda.stream(stream):
        for b in reversed(buckets):
            with dispatch.pdl_for_rows(b):  # compiled in the warm-up runs, baked in the graph
                attn = attention(b)
                for _ in range(2):
                    forward(b, attn)
                stream.synchronize()
                graphs[b] = capture_graph(lambda: forward(b, attn), pool, stream)  # noqa: B023 (called at once)
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


@contextlib.contextmanager
def gc_paused(collect: bool = True) -> Iterator[None]:
    """No garbage collection inside a capture: a collected pinned host tensor (e.g. an earlier step's transfer
    buffer) makes the host allocator query its CUDA event, which is illegal while a stream captures and
    invalidates the graph. So collect now (unless `collect` is False: a capture while serving, where a full
    collection of the engine's heap would stall the step), then not until the block ends."""
    if collect:
        gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def capture_graph(
    run: Callable[[], T], pool: Any, stream: torch.cuda.Stream, *, while_serving: bool = False
) -> tuple[torch.cuda.CUDAGraph, T]:
    """(graph, run()'s output) of run() captured on `stream` into `pool`; the caller holds `gc_paused`.
    thread_local: another thread's CUDA calls (an API thread, a tokenizer pool) cannot invalidate the capture;
    this thread's own illegal calls still fail loudly.

    At startup `torch.cuda.graph` first synchronizes the device and empties the device and pinned-host
    allocator caches, so the graphs are captured into as much free memory as there is. `while_serving` skips
    that: between two steps of a running engine, emptying the caches hands back the memory the next steps
    allocate again (and the pinned transfer buffers they reuse), a stall the request that brought the capture
    would pay. The caller orders `stream` after the work whose results the capture reads."""
    graph = torch.cuda.CUDAGraph()
    if not while_serving:
        with torch.cuda.graph(graph, pool=pool, stream=stream, capture_error_mode="thread_local"):
            out = run()
        return graph, out
    with torch.cuda.stream(stream):
        graph.capture_begin(pool=pool, capture_error_mode="thread_local")
        try:
            out = run()
        finally:
            graph.capture_end()
    return graph, out
