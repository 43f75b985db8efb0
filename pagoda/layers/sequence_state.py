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

import torch


@dataclass
class SequenceStateBatch:
    slots: torch.Tensor                 # [B] int64: state slot of each request row
    first_token: torch.Tensor           # [B] int64: flat index of each row's first token this step
    last_token: torch.Tensor            # [B] int64: flat index of each row's last token this step
    one_token_per_row: bool             # pure decode step: every row is exactly one token
    snapshot_tokens: torch.Tensor | None = None  # [S] flat indices of tokens that complete a KV block
    snapshot_blocks: torch.Tensor | None = None  # [S] the block each of those tokens completes

    @classmethod
    def build(cls, slots: list[int], query_start_loc: list[int], positions: torch.Tensor,
              slot_mapping: torch.Tensor, block_size: int, with_snapshots: bool) -> SequenceStateBatch:
        """Indices for one step. `positions`/`slot_mapping` [T] are the step's (on device)."""
        device = positions.device
        starts = torch.tensor(query_start_loc, dtype=torch.long, device=device)
        one_each = query_start_loc[-1] == len(slots)
        snap_tokens = snap_blocks = None
        if with_snapshots:
            ends = torch.nonzero(positions % block_size == block_size - 1).flatten()
            if ends.numel():
                snap_tokens, snap_blocks = ends, slot_mapping[ends] // block_size
        return cls(torch.tensor(slots, dtype=torch.long, device=device), starts[:-1], starts[1:] - 1,
                   one_each, snap_tokens, snap_blocks)
