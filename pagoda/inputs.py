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
    # when `pixel_lut` is None. With `temporal_repeat` = T > 1 (a still image, whose T frames per temporal
    # patch are the same frame) each row holds that one frame, [num_patches, 3 * p * p], and the encoder
    # input repeats it T times (`expand_temporal`): half the bytes to hash, send and copy.
    pixel_values: np.ndarray
    grid_thw: tuple[int, int, int]  # patch grid (t, h, w) before the 2x2 merge
    offset: int  # index of the item's first placeholder token in the prompt
    length: int  # number of placeholder tokens (= t * h * w / merge**2)
    content_hash: bytes  # pixels (+ table) + grid + processor settings (16 bytes)
    pixel_lut: np.ndarray | None = None
    temporal_repeat: int = 1

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
    temporal_repeat: int = 1,
) -> bytes:
    """Identity of an encoder input: the exact pixels the encoder sees (after resize/normalise; levels
    and their table when normalisation is deferred; one frame and its repeat count for a still image), their
    grid and the processor settings. SHA-256 (truncated to 16 bytes): CPUs hash it in hardware, about twice
    as fast as BLAKE2b, and the API process hashes every image it receives."""
    h = hashlib.sha256()
    header = f"{modality}|{grid_thw}|{settings}|{pixel_values.dtype}|{pixel_values.shape}|x{temporal_repeat}"
    h.update(header.encode())
    h.update(np.ascontiguousarray(pixel_values).data)
    if pixel_lut is not None:
        h.update(np.ascontiguousarray(pixel_lut, dtype=np.float32).data)
    return h.digest()[:16]


def expand_temporal(rows, temporal_repeat: int, channels: int = 3):
    """Encoder rows [P, C * p * p] of one frame → [P, C * T * p * p] with the frame repeated T times per channel
    (columns (c, tau, y, x), the processor's order); numpy arrays and torch tensors alike. T = 1: the rows as they
    are."""
    if temporal_repeat == 1:
        return rows
    patches, width = rows.shape
    per_channel = width // channels
    grouped = rows.reshape(patches, channels, 1, per_channel)
    if isinstance(grouped, np.ndarray):
        repeated = np.broadcast_to(grouped, (patches, channels, temporal_repeat, per_channel))
    else:
        repeated = grouped.expand(patches, channels, temporal_repeat, per_channel)
    return repeated.reshape(patches, channels * temporal_repeat * per_channel)
