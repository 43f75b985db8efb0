"""One step's inputs, built once from the scheduler's output and the runner's request states.

`StepInputs` is what every way of running a step reads — eager, a decode graph, a mixed-step graph —
so a step is described in exactly one place: B rows (requests, in the scheduler's order) and T tokens
flattened row after row. All arrays are host (numpy) int64; the one device part is `late_tokens`.

Async scheduling launches step N+1 before step N's samples are read: a row whose input token is
step N's sample (`num_pending`) gets a placeholder 0 in `token_ids`, and `late_tokens` names the
flat index and the device tensor holding the real id (the last step's samples), written over the
placeholder on the device, so the host never waits for it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pagoda.device_copy import to_device
from pagoda.worker.request_states import RunnerRequestState


@dataclass
class SpecRows:
    """The proposals of a step's sampling rows, in sample-row order."""

    counts: np.ndarray  # [S] proposals per sampling row (0: an ordinary row)
    proposals: list[list[int]]  # [S] the proposals themselves
    greedy: np.ndarray  # [S] bool: the row samples greedily (temperature 0)
    penalized: np.ndarray  # [S] bool: the row has a repetition, frequency or presence penalty
    logprobs: np.ndarray  # [S] int64: the row's SamplingParams.logprobs, -1 for None


@dataclass
class StepInputs:
    """One step of B rows and T tokens, host side."""

    token_ids: np.ndarray  # [T] (0 where `late_tokens` fills in the id)
    positions: np.ndarray  # [T]
    slots: np.ndarray  # [T] cache slot of each token's K/V
    query_start_loc: np.ndarray  # [B + 1] each row's first token in the flat axis
    seq_lens: np.ndarray  # [B] context length after this step (cached + new)
    block_tables: np.ndarray  # [B, max_blocks] padded with the null block 0
    sample_rows: np.ndarray  # [S] rows that sample this step, ascending (the scheduler's decision)
    state_slots: np.ndarray | None = None  # [B] per-sequence state slots (stateful models)
    mrope_positions: np.ndarray | None = None  # [3, T] (M-RoPE models, when a row has multimodal inputs)
    # (flat token index, token id) device tensors for tokens the host has not seen yet.
    late_tokens: tuple[torch.Tensor, torch.Tensor] | None = None
    needs_encoder: bool = False  # a row's scheduled range covers part of an image or video
    spec: SpecRows | None = None  # speculative proposals of the sampling rows (`worker/spec_rows.py`)
    # (flat token index, snapshot entry) [2 x N]: states a verification step keeps to roll back to (stateful models)
    state_writes: tuple[np.ndarray, np.ndarray] | None = None

    @property
    def num_rows(self) -> int:
        return len(self.seq_lens)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def is_decode(self) -> bool:
        """Every row has exactly one token (rows == tokens)."""
        return self.num_tokens == self.num_rows

    @property
    def query_lens(self) -> np.ndarray:
        return np.diff(self.query_start_loc)

    @property
    def tokens_as_rows(self) -> bool:
        """A verification step (`worker/spec_rows.py`) whose every token is a logits position, of a model without
        per-sequence state and with no encoder work: each token can run as a decode row of its own (its context:
        its position + 1, its request's block table), since every token's K/V is stored before any row attends."""
        return (
            self.spec is not None
            and self.state_slots is None
            and not self.needs_encoder
            and len(self.sample_rows) == self.num_rows
            and int(self.spec.counts.sum()) + self.num_rows == self.num_tokens
        )

    @property
    def starts(self) -> np.ndarray:
        """[B] tokens already cached per row before this step."""
        return self.seq_lens - self.query_lens


def overlaps_encoder_item(states: list[RunnerRequestState], starts: list[int], ends: list[int]) -> bool:
    """Whether any row's scheduled range [start, end) covers part of one of its images/videos."""
    return any(
        s.mm_inputs is not None and any(item.overlaps(a, e) for item in s.mm_inputs.items)
        for s, a, e in zip(states, starts, ends)
    )


def mrope_positions(states: list[RunnerRequestState], starts: list[int], ends: list[int]) -> np.ndarray:
    """[3, T]: prompt tokens from each request's precomputed table, the rest (generated tokens,
    text-only requests) at index + rope delta on all three axes."""
    if all(e - a == 1 for a, e in zip(starts, ends)):
        return _mrope_one_token_each(states, starts)
    parts = []
    for s, a, e in zip(states, starts, ends):
        table = s.mm_inputs.mrope_positions if s.mm_inputs is not None else None
        known = min(e, table.shape[1]) if table is not None else a
        if known > a:
            parts.append(table[:, a:known])
        if e > known:
            delta = s.mm_inputs.mrope_delta if s.mm_inputs is not None else 0
            parts.append(np.broadcast_to(np.arange(max(a, known), e) + delta, (3, e - max(a, known))))
    return np.ascontiguousarray(np.concatenate(parts, axis=1))


def _mrope_one_token_each(states: list[RunnerRequestState], starts: list[int]) -> np.ndarray:
    """`mrope_positions` of a step of one token per row (a decode step: most steps of a served Qwen2-VL) without a
    numpy call per row: position + delta on all three axes, then the few rows still inside their prompt's table."""
    mm = [s.mm_inputs for s in states]
    delta = np.fromiter((0 if m is None else m.mrope_delta for m in mm), np.int64, len(mm))
    out = np.repeat((np.asarray(starts, np.int64) + delta)[None, :], 3, axis=0)
    for i, (m, a) in enumerate(zip(mm, starts)):
        if m is not None and a < m.mrope_positions.shape[1]:
            out[:, i] = m.mrope_positions[:, a]
    return out


class StepInputsBuilder:
    """Builds `StepInputs` for the runner. Pure decode steps (one token per row, most steps while
    serving) take a vectorised path; both paths give the same arrays."""

    def __init__(self, block_size: int, device: torch.device, stateful: bool, uses_mrope: bool, has_encoder: bool):
        self.block_size = block_size
        self.device = device
        self.stateful = stateful  # rows carry a state slot
        self.uses_mrope = uses_mrope  # rows with multimodal inputs carry M-RoPE positions
        self.has_encoder = has_encoder  # rows may need the encoder's output
        self._arange: torch.Tensor | None = None  # 0, 1, 2, ... on the device (`_late_tokens`)

    def build(
        self,
        request_ids: list[str],
        states: list[RunnerRequestState],
        query_lens: list[int],
        sampling: set[str],
        last_sampled: torch.Tensor | None,
    ) -> StepInputs:
        """Rows in `request_ids` order; `query_lens` tokens each from its `num_computed_tokens`;
        `sampling`: the scheduler's requests that sample this step; `last_sampled`: the last launched
        step's sampled ids on the device (the source of pending tokens)."""
        if sum(query_lens) == len(states):
            inputs, late_rows = self._decode(states)
        else:
            inputs, late_rows = self._general(states, query_lens)
        inputs.sample_rows = np.fromiter(
            (i for i, rid in enumerate(request_ids) if rid in sampling), np.int64, count=-1
        )
        if self.stateful:
            inputs.state_slots = np.fromiter((s.state_slot for s in states), np.int64, len(states))
        if (self.has_encoder or self.uses_mrope) and any(s.mm_inputs is not None for s in states):
            starts, ends = inputs.starts.tolist(), inputs.seq_lens.tolist()
            inputs.needs_encoder = self.has_encoder and overlaps_encoder_item(states, starts, ends)
            if self.uses_mrope:
                inputs.mrope_positions = mrope_positions(states, starts, ends)
        if len(late_rows):
            flat = inputs.query_start_loc[1:][late_rows] - 1  # a late token is its row's last
            inputs.late_tokens = self._late_tokens(states, late_rows, flat, last_sampled)
        return inputs

    def _decode(self, states: list[RunnerRequestState]) -> tuple[StepInputs, np.ndarray]:
        n, bs = len(states), self.block_size
        positions = np.fromiter((s.num_computed_tokens for s in states), np.int64, n)
        known = np.fromiter((len(s.token_ids) for s in states), np.int64, n)
        token_ids = np.fromiter(
            (s.token_ids[p] if p < k else 0 for s, p, k in zip(states, positions.tolist(), known.tolist())), np.int64, n
        )
        block_of = np.fromiter((s.block_ids[p // bs] for s, p in zip(states, positions.tolist())), np.int64, n)
        inputs = StepInputs(
            token_ids,
            positions,
            block_of * bs + positions % bs,
            np.arange(n + 1, dtype=np.int64),
            positions + 1,
            self._tables(states),
            _NO_ROWS,
        )
        return inputs, np.flatnonzero(positions >= known)

    def _general(self, states: list[RunnerRequestState], query_lens: list[int]) -> tuple[StepInputs, np.ndarray]:
        starts = [s.num_computed_tokens for s in states]
        ends = [a + n for a, n in zip(starts, query_lens)]
        # A row ending past its known tokens ends on its pending token: a placeholder here.
        late_rows = np.asarray([i for i, (s, e) in enumerate(zip(states, ends)) if e > len(s.token_ids)], np.int64)
        token_ids = np.concatenate(
            [
                np.asarray(s.token_ids[a:e] + [0] * (e - max(a, len(s.token_ids))), dtype=np.int64)
                if e > len(s.token_ids)
                else np.asarray(s.token_ids[a:e], dtype=np.int64)
                for s, a, e in zip(states, starts, ends)
            ]
        )
        positions = np.concatenate([np.arange(a, e, dtype=np.int64) for a, e in zip(starts, ends)])
        tables = self._tables(states)
        row_of_token = np.repeat(np.arange(len(states)), query_lens)
        bs = self.block_size
        slots = tables[row_of_token, positions // bs] * bs + positions % bs
        query_start_loc = np.zeros(len(states) + 1, dtype=np.int64)
        np.cumsum(query_lens, out=query_start_loc[1:])
        seq_lens = np.asarray(ends, dtype=np.int64)
        return StepInputs(token_ids, positions, slots, query_start_loc, seq_lens, tables, _NO_ROWS), late_rows

    @staticmethod
    def _tables(states: list[RunnerRequestState]) -> np.ndarray:
        tables = np.zeros((len(states), max(len(s.block_ids) for s in states)), dtype=np.int64)  # null-padded
        for row, s in enumerate(states):
            tables[row, : len(s.block_ids)] = s.block_ids
        return tables

    def _late_tokens(
        self,
        states: list[RunnerRequestState],
        rows: np.ndarray,
        flat_index: np.ndarray,
        last_sampled: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(flat token index, token id) on the device for rows whose input is the last launched
        step's sample, not yet on the host."""
        src = []
        for i in rows.tolist():
            s = states[i]
            assert s.num_pending == 1 and last_sampled is not None, "a pending token from an older step"
            src.append(s.pending_row)
        # The steady state of a batch that keeps its rows (always at batch 1): row i takes sample i
        # into token i. Then a slice and a cached index stand in for the gather and the two
        # host-to-device copies (each a few µs of a GPU-bound batch-1 step).
        src_np = np.asarray(src, dtype=np.int64)
        flat_np = np.asarray(flat_index, dtype=np.int64)
        n = len(src_np)
        ascending = np.arange(n)
        values = (
            last_sampled[:n]
            if np.array_equal(src_np, ascending)
            else last_sampled.index_select(0, to_device(src_np, self.device))
        )
        index = self._device_arange(n) if np.array_equal(flat_np, ascending) else to_device(flat_np, self.device)
        return index, values

    def _device_arange(self, n: int) -> torch.Tensor:
        """torch.arange(n) on the device, sliced from one cached tensor."""
        if self._arange is None or self._arange.numel() < n:
            self._arange = torch.arange(max(n, 256), dtype=torch.int64, device=self.device)
        return self._arange[:n]


_NO_ROWS = np.zeros(0, dtype=np.int64)


def one_prompt_inputs(n: int, block_size: int, max_position: int | None = None) -> StepInputs:
    """Inputs of one n-token prompt (ids 0) over KV blocks 1, 2, ...; positions wrap at max_position."""
    tokens = np.arange(n, dtype=np.int64)
    blocks = np.arange(1, -(-n // block_size) + 1, dtype=np.int64)
    return StepInputs(
        np.zeros(n, dtype=np.int64),
        tokens % max_position if max_position else tokens,
        tokens + block_size,  # blocks 1.. in order: slot = block * block_size + offset
        np.array([0, n], dtype=np.int64),
        np.array([n], dtype=np.int64),
        blocks[None, :],
        np.array([0], dtype=np.int64),
    )
