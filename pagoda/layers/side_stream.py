"""Run an independent piece of a layer on a second CUDA stream, overlapping the main chain.

Why: at decode batch sizes a small matmul is bound by the fixed cost of one kernel (an 8 MB
projection takes about as long at M = 1 as at 256, several times its weight stream's time:
`benchmarks/kernels/gemv_sweep.py`), so two independent small matmuls that run side by side cost
little more than one. Yuan2's v_proj reads the layer input, not the LF gate's output, so it can run
while conv1 → conv2 → norm → qk run.

Inside a CUDA graph capture the fork and join become graph edges (no extra kernels); outside one
they are two event waits. Memory: the branch's outputs are allocated on the side stream and freed
after the main stream used them; the next fork waits on the main stream first, so any reuse of
that memory by the side stream is ordered after those uses (no `record_stream` needed).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch

T = TypeVar("T")

_STREAMS: dict[tuple[int, int], torch.cuda.Stream] = {}


def _side_stream(device: torch.device, lane: int) -> torch.cuda.Stream:
    index = device.index if device.index is not None else torch.cuda.current_device()
    stream = _STREAMS.get((index, lane))
    if stream is None:
        stream = _STREAMS[index, lane] = torch.cuda.Stream(index)
    return stream


class Branch:
    """`Branch(fn, *args)` forks: fn(*args) is queued on the side stream after the main stream's work
    so far; `join()` returns its result and makes the main stream wait for it. On CPU (or when
    `enabled` is False) fn simply runs inline in the constructor. Branches of different `lane`s run
    on different side streams, so one lane's work never queues behind another's."""

    def __init__(self, fn: Callable[..., T], *args: torch.Tensor, enabled: bool = True, lane: int = 0):
        first = args[0]
        self._side = _side_stream(first.device, lane) if enabled and first.is_cuda else None
        if self._side is None:
            self._result = fn(*args)
            return
        main = torch.cuda.current_stream(first.device)
        self._main = main
        self._side.wait_stream(main)
        with torch.cuda.stream(self._side):
            self._result = fn(*args)

    def join(self) -> T:
        if self._side is not None:
            self._main.wait_stream(self._side)
        return self._result
