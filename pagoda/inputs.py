"""What a multimodal prompt carries into the engine, beside its token ids.

The API process turns each image / video of a request into a `MultiModalItem`: preprocessed
pixels, the patch grid, where its placeholder tokens sit in the (expanded) prompt, and a content
hash. The hash identifies the item everywhere downstream: the runner's encoder-output cache and the
prefix cache's block hashes (two different images behind identical placeholder ids must never share
KV blocks). M-RoPE positions for the whole prompt are computed once, at admission.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import numpy as np


@dataclass
class MultiModalItem:
    modality: str  # "image" | "video"
    # Encoder input [num_patches, 3 * T * p * p]: uint8 levels normalised through `pixel_lut` (float32
    # [3, 256], the value of each level per channel) where they are used, or float32 already normalised
    # when `pixel_lut` is None.
    pixel_values: np.ndarray
    grid_thw: tuple[int, int, int]  # patch grid (t, h, w) before the 2x2 merge
    offset: int  # index of the item's first placeholder token in the prompt
    length: int  # number of placeholder tokens (= t * h * w / merge**2)
    content_hash: bytes  # pixels (+ table) + grid + processor settings (16 bytes)
    pixel_lut: np.ndarray | None = None

    @property
    def end(self) -> int:
        return self.offset + self.length

    def overlaps(self, start: int, end: int) -> bool:
        return self.offset < end and start < self.end


@dataclass
class MultiModalInputs:
    items: list[MultiModalItem]
    mrope_positions: np.ndarray  # [3, prompt_len] int64: (t, h, w) position of every prompt token
    mrope_delta: int  # generated token i sits at i + delta on all three axes
    counts: dict[str, int] = field(default_factory=dict)  # placeholder tokens per modality (for messages)

    def block_extra_key(self, start: int, end: int) -> bytes:
        """Extra bytes for the prefix-cache hash of the block holding tokens [start, end): the hash
        and relative offset of every item overlapping it."""
        parts = [
            item.content_hash + (item.offset - start).to_bytes(8, "little", signed=True)
            for item in self.items
            if item.overlaps(start, end)
        ]
        return b"".join(parts)


def content_hash(
    modality: str,
    pixel_values: np.ndarray,
    grid_thw: tuple[int, int, int],
    settings: str,
    pixel_lut: np.ndarray | None = None,
) -> bytes:
    """Identity of an encoder input: the exact pixels the encoder sees (after resize/normalise; levels
    and their table when normalisation is deferred), their grid and the processor settings."""
    h = hashlib.blake2b(digest_size=16)
    h.update(f"{modality}|{grid_thw}|{settings}|{pixel_values.dtype}|{pixel_values.shape}".encode())
    h.update(np.ascontiguousarray(pixel_values).data)
    if pixel_lut is not None:
        h.update(np.ascontiguousarray(pixel_lut, dtype=np.float32).data)
    return h.digest()
