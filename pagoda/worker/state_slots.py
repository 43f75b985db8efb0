"""The memory behind per-sequence recurrent state (see `layers/sequence_state.py`).

- `state`     [num_layers, num_slots + 1, width]: one slot per running sequence (num_slots =
  max_num_seqs, since only running sequences hold one). A slot is zeroed when handed out — zeros
  are exactly the state before a sequence's first token — or filled from a prefix-cache snapshot.
- `snapshots` [num_layers, num_blocks, width]: the state after the last token of each KV block,
  written by the layers while they compute that token; allocated with the KV cache, only when
  prefix caching is on. With speculative decoding, `spec_positions` (1 + k) more per slot past them
  (`spec_base` on): a verification step writes the state after every position of its proposal rows
  there, and each row rolls its slot back to the position of its last kept token (`roll_back`). Entry 0
  is always the null block's, which padding writes into.
Slots are handed out by the model runner, keyed by request, and freed when a request finishes or
is preempted (recompute restarts from zero state or from a snapshot).
"""

from __future__ import annotations

from typing import Protocol

import numpy as np
import torch


class StatefulLayer(Protocol):
    state_width: int

    def bind_state(self, state: torch.Tensor, snapshots: torch.Tensor) -> None: ...


class StateSlotPool:
    def __init__(
        self,
        layers: list[StatefulLayer],
        num_slots: int,
        dtype: torch.dtype,
        device: torch.device,
        spec_positions: int = 0,
    ):
        widths = {layer.state_width for layer in layers}
        assert len(widths) == 1, f"stateful layers must share one state width, got {widths}"
        self.layers = layers
        self.width = widths.pop()
        # One spare slot past the handed-out ones: padding rows of a captured decode step (CUDA
        # graphs run a fixed number of rows) read and write it, never a live sequence's slot.
        self.scratch_slot = num_slots
        self.state = torch.zeros(len(layers), num_slots + 1, self.width, dtype=dtype, device=device)
        self.snapshots = torch.empty(len(layers), 0, self.width, dtype=dtype, device=device)
        self._free = list(range(num_slots - 1, -1, -1))  # pop() hands out slot 0 first
        self.spec_positions, self.spec_base = spec_positions, 0
        self._bind()

    @property
    def bytes_per_seq(self) -> int:
        return len(self.layers) * self.width * self.state.element_size()

    def _bind(self) -> None:
        for index, layer in enumerate(self.layers):
            layer.bind_state(self.state[index], self.snapshots[index])

    def allocate_snapshots(self, num_blocks: int) -> None:
        """num_blocks: 0 without prefix caching (then only the null entry and the speculative ones, if any)."""
        if self.spec_positions:
            num_blocks = max(num_blocks, 1)
        self.spec_base = num_blocks
        total = num_blocks + self.spec_positions * self.scratch_slot
        # Uninitialised: a snapshot is only read for a block (or position) whose token wrote it first.
        state = self.state
        self.snapshots = torch.empty(len(self.layers), total, self.width, dtype=state.dtype, device=state.device)
        self._bind()

    def spec_ids(self, rows: np.ndarray, offsets: np.ndarray) -> np.ndarray:
        """The entries of sampling row `rows[i]`'s position `offsets[i]` in a verification step."""
        return self.spec_base + rows * self.spec_positions + offsets

    def roll_back(self, slots: torch.Tensor, ids: torch.Tensor) -> None:
        """state[slots[i]] = the state at entry ids[i] (device indices: no host sync)."""
        self.state.index_copy_(1, slots, self.snapshots.index_select(1, ids))

    def drop_snapshots(self) -> None:
        self.snapshots = self.snapshots[:, :0]
        self._bind()

    def acquire(self) -> int:
        """A zeroed slot (the state of a sequence before its first token)."""
        if not self._free:
            raise RuntimeError("no free sequence-state slot: more running sequences than max_num_seqs")
        slot = self._free.pop()
        self.state[:, slot].zero_()
        return slot

    def release(self, slot: int) -> None:
        self._free.append(slot)

    def restore(self, slot: int, block: int) -> None:
        """Continue from a cached prefix: the state after the last token of `block`."""
        if self.snapshots.shape[1] <= block:
            raise RuntimeError("prefix-cache hit on a stateful model without state snapshots")
        self.state[:, slot] = self.snapshots[:, block]
