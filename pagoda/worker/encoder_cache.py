"""Encoder outputs (vision-tower embeddings) by item content hash, least recently used evicted first.

An image's encoder output is needed by every prefill chunk that covers part of its placeholder
tokens, again after preemption (recompute), and by other requests sending the same image; the
vision tower must never run on part of an item, so its whole output is kept here. Capacity is in
placeholder tokens (rows), like vLLM's encoder cache budget.
"""

from __future__ import annotations

from collections import OrderedDict

import torch


class EncoderCache:
    def __init__(self, capacity_tokens: int):
        self.capacity_tokens = capacity_tokens
        self._entries: OrderedDict[bytes, torch.Tensor] = OrderedDict()
        self._tokens = 0
        self.hits = 0
        self.misses = 0

    def get(self, key: bytes) -> torch.Tensor | None:
        value = self._entries.get(key)
        if value is None:
            self.misses += 1
            return None
        self.hits += 1
        self._entries.move_to_end(key)
        return value

    def put(self, key: bytes, value: torch.Tensor) -> None:
        if key in self._entries:
            return
        self._entries[key] = value
        self._tokens += value.shape[0]
        while self._tokens > self.capacity_tokens and len(self._entries) > 1:
            _, evicted = self._entries.popitem(last=False)
            self._tokens -= evicted.shape[0]

    def __len__(self) -> int:
        return len(self._entries)
