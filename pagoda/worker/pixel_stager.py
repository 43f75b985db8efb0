"""Encoder inputs moved into pinned host memory when their request arrives, off the step thread.

An image's uint8 levels are a few MB ([patch rows, C * T * p * p]; 3,888 x 1,176 for a 1000x750 picture).
Copying them to the GPU without a host-device sync needs them in pinned memory first, and that host copy
(pinned block, memcpy, first touch of the pages) is milliseconds per image. Made inside the step that
encodes the image, it held the engine core's only thread while the GPU waited for its next launch. The
stager makes it at admission instead, on its own thread (the copy releases the GIL), so by the time the
scheduler picks the request its pixels are pinned and the step only queues the device copy.

Invariants: only the engine's thread calls `stage` and `take` (the pool thread only copies); what is
staged is bounded by `max_bytes` (oldest dropped first: a dropped or never-staged item is pinned inline by
`take`, as before); an item already in the encoder cache is not staged. Switch: PAGODA_PIXEL_STAGING.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch

from pagoda.inputs import MultiModalItem

Pinned = tuple[torch.Tensor, torch.Tensor | None]  # (levels or patches, per-channel table) in pinned memory


def pin_item(item: MultiModalItem, pin: Callable[[torch.Tensor], torch.Tensor]) -> Pinned:
    levels = pin(torch.from_numpy(np.ascontiguousarray(item.pixel_values)))
    lut = None if item.pixel_lut is None else pin(torch.from_numpy(item.pixel_lut.astype(np.float32, copy=False)))
    return levels, lut


class PixelStager:
    def __init__(
        self,
        max_bytes: int,
        is_cached: Callable[[bytes], bool],
        pin: Callable[[torch.Tensor], torch.Tensor] = torch.Tensor.pin_memory,
    ):
        self.max_bytes = max_bytes
        self._is_cached = is_cached
        self._pin = pin
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="pagoda-pixels")
        self._staged: OrderedDict[bytes, tuple[Future[Pinned], int]] = OrderedDict()
        self._bytes = 0
        self.staged_hits = 0  # items `take` found staged (for tests and profiles)

    @property
    def staged_bytes(self) -> int:
        return self._bytes

    def stage(self, items: Iterable[MultiModalItem]) -> None:
        for item in items:
            key, size = item.content_hash, item.pixel_values.nbytes
            if key in self._staged or self._is_cached(key) or size > self.max_bytes:
                continue
            self._staged[key] = (self._pool.submit(pin_item, item, self._pin), size)
            self._bytes += size
            while self._bytes > self.max_bytes:
                _, (_, dropped) = self._staged.popitem(last=False)
                self._bytes -= dropped

    def take(self, item: MultiModalItem) -> Pinned:
        """The item's pinned inputs, staged earlier or pinned now; the staged copy is handed over once."""
        entry = self._staged.pop(item.content_hash, None)
        if entry is not None:
            future, size = entry
            self._bytes -= size
            try:
                pinned = future.result()
            except Exception:  # noqa: BLE001 - pinning failed on the pool thread: try again here, where it raises
                pass
            else:
                self.staged_hits += 1
                return pinned
        return pin_item(item, self._pin)
