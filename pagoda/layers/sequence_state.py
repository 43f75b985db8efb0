"""Per-sequence recurrent state beside the paged KV cache (Yuan2's localized-filtering state).

Some layers need, for each sequence, a small fixed-size summary of the tokens before the current
step (Yuan2's LF gate: the previous token's filter input and first-convolution output). It is kept
in a pool of *state slots*, one per running sequence, assigned by the model runner when a sequence
is (re)admitted and looked up by sequence — never by batch row, since rows change every step.

Per step the runner describes where each sequence's tokens sit in the flattened batch
(`SequenceStateBatch`); a stateful layer reads the slots of the rows, runs every row's tokens as
one segment that continues from its slot, and writes the state after each row's last token back.

Prefix caching: the state after the last token of every full KV block is also written into a
per-block snapshot, so a later request that reuses those cached blocks starts from the exact state
(restored into its slot) instead of recomputing the prefix.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pagoda.device_copy import to_device


@dataclass
class SequenceStateBatch:
    slots: torch.Tensor  # [B] int64: state slot of each request row
    first_token: torch.Tensor  # [B] int64: flat index of each row's first token this step
    last_token: torch.Tensor  # [B] int64: flat index of each row's last token this step
    one_token_per_row: bool  # pure decode step: every row is exactly one token
    snapshot_tokens: torch.Tensor | None = None  # [S] flat indices of tokens that complete a KV block
    snapshot_blocks: torch.Tensor | None = None  # [S] the block each of those tokens completes
    # snapshot_tokens is every token 0..T-1 in order (captured decode steps, where the tokens that
    # complete no block write into the null block's snapshot instead of being left out).
    snapshot_every_row: bool = False

    @classmethod
    def build(
        cls,
        slots: list[int],
        query_start_loc: np.ndarray,
        positions: np.ndarray,
        slot_mapping: np.ndarray,
        block_size: int,
        with_snapshots: bool,
        device: torch.device,
        extra: tuple[np.ndarray, np.ndarray] | None = None,
    ) -> SequenceStateBatch:
        """Indices for one step, computed on the host from the runner's numpy inputs (no device sync).
        extra: more (flat token, snapshot entry) pairs to write (a verification step's positions)."""
        one_each = int(query_start_loc[-1]) == len(slots)
        snap_tokens = snap_blocks = None
        ends, entries = snapshot_pairs(positions, slot_mapping, block_size, with_snapshots, extra)
        if ends.size:
            snap_tokens = to_device(ends, device)
            snap_blocks = to_device(entries, device)
        starts = to_device(np.asarray(query_start_loc, dtype=np.int64), device)
        return cls(
            to_device(np.asarray(slots, dtype=np.int64), device),
            starts[:-1],
            starts[1:] - 1,
            one_each,
            snap_tokens,
            snap_blocks,
        )


def snapshot_pairs(
    positions: np.ndarray,
    slot_mapping: np.ndarray,
    block_size: int,
    block_ends: bool,
    extra: tuple[np.ndarray, np.ndarray] | None,
) -> tuple[np.ndarray, np.ndarray]:
    """(flat token, snapshot entry) of every state snapshot a step writes: with `block_ends`, each token that
    completes a KV block into that block's entry; then the `extra` pairs (a verification step's positions)."""
    ends = np.flatnonzero(positions % block_size == block_size - 1) if block_ends else np.zeros(0, np.int64)
    entries = slot_mapping[ends] // block_size
    if extra is not None:
        ends, entries = np.concatenate([ends, extra[0]]), np.concatenate([entries, extra[1]])
    return ends, entries
