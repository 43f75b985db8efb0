"""Qwen2-VL M-RoPE position ids, with the original Qwen / transformers 4.x / vLLM semantics
(docs/models.md, Qwen2-VL: M-RoPE positions).

Walk the prompt keeping `next` (starts at 0). A text token gets (next, next, next) and advances it
by one. The placeholder run of an item with patch grid (t, h, w) is an LLM grid (T', H', W') =
(t, h/m, w/m) in raster order (a outer, then b, then c); the token at (a, b, c) gets
(s + a, s + b, s + c) with s = next, and then next = s + max(T', H', W'). rope_delta =
(largest position + 1) - prompt length: generated token i is at i + rope_delta on every axis.
"""

from __future__ import annotations

import numpy as np

from pagoda.inputs import MultiModalItem


def mrope_positions(prompt_len: int, items: list[MultiModalItem], merge_size: int = 2) -> tuple[np.ndarray, int]:
    """[3, prompt_len] int64 positions and the rope delta; items sorted by offset, non-overlapping."""
    positions = np.empty((3, prompt_len), dtype=np.int64)
    cursor = 0  # next token index to place
    next_pos = 0
    for item in sorted(items, key=lambda i: i.offset):
        text = item.offset - cursor
        positions[:, cursor : item.offset] = np.arange(next_pos, next_pos + text)
        next_pos += text
        t, h, w = item.grid_thw[0], item.grid_thw[1] // merge_size, item.grid_thw[2] // merge_size
        assert t * h * w == item.length, f"item of grid {item.grid_thw} needs {t * h * w} tokens, has {item.length}"
        a, b, c = np.meshgrid(np.arange(t), np.arange(h), np.arange(w), indexing="ij")
        positions[0, item.offset : item.end] = next_pos + a.reshape(-1)
        positions[1, item.offset : item.end] = next_pos + b.reshape(-1)
        positions[2, item.offset : item.end] = next_pos + c.reshape(-1)
        next_pos += max(t, h, w)
        cursor = item.end
    positions[:, cursor:] = np.arange(next_pos, next_pos + prompt_len - cursor)
    delta = int(positions.max()) + 1 - prompt_len if prompt_len else 0
    return positions, delta
