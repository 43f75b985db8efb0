"""CUDA graphs of the multimodal encoder's forward, one per set of item shapes that keeps coming back.

Why: one vision-tower forward is ~700 kernel launches (32 blocks of norms, GEMMs, rotary, attention). For
one or two images the engine's thread spends about twice the GPU's time launching them, and launches
nothing else meanwhile, so a step that brings a lone image is bound by the host, not the GPU. Replaying a
graph is one launch.

Key: the items' grids, in order (the row order and rotary tables of the forward follow from them, made
once by the model's `encoder_plan` and kept with the graph). A key is captured the `after`-th time it is
met (the eager forwards before it also let the attention settle on its kernel: `layers/segment_attention`),
and only when its patch rows number at most `max_patches`: a graph keeps its input and output buffers, and
a forward over many images is bound by the GPU anyway. At most `max_graphs` keys are captured; they share
one memory pool, which is safe because replays never overlap (one engine thread, one stream) and every
replay's output is copied out before the next one runs, so the pool holds about the largest captured
forward's activations. Memory outside the KV budget (graphs are captured while serving, after the cache is
sized): for Qwen2-VL's tower at the defaults, ~0.3 GB of pool plus ~25 MB of input and output per graph,
~0.7 GB at most, inside the share `--gpu-memory-utilization` leaves free.

The switch is `PAGODA_ENCODER_GRAPH_PATCHES` (0: always eager); `--enforce-eager` turns it off too.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import torch

from pagoda.worker.graph_runner import capture_graph, gc_paused

logger = logging.getLogger(__name__)

Grids = tuple[tuple[int, int, int], ...]


class CapturePolicy:
    """Which keys to capture: a key's `after`-th sighting, within `max_patches` rows, while fewer than
    `max_graphs` are held. Pure bookkeeping (no device), so the rule is tested on its own."""

    def __init__(self, max_patches: int, after: int = 3, max_graphs: int = 16):
        assert max_patches >= 0 and after >= 1 and max_graphs >= 0
        self.max_patches, self.after, self.max_graphs = max_patches, after, max_graphs
        self._sightings: dict[Grids, int] = {}
        self.captured = 0

    def should_capture(self, key: Grids, patches: int) -> bool:
        """Count a sighting of an uncaptured key; True when it is to be captured now (the caller then
        calls `did_capture`)."""
        if patches > self.max_patches or self.captured >= self.max_graphs:
            return False
        seen = self._sightings.get(key, 0) + 1
        self._sightings[key] = seen
        return seen >= self.after

    def did_capture(self, key: Grids) -> None:
        self._sightings.pop(key, None)
        self.captured += 1


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    inputs: torch.Tensor  # [P, C·T·p·p] in the encoder's dtype: each replay's pixels are copied in here
    output: torch.Tensor  # [P / merge², H]: overwritten by each replay
    plan: Any  # the model's plan for the key (device tensors the graph reads)


class EncoderGraphs:
    """`run(pixels, grids)`: the encoder's output from a graph of that key, or None (the caller runs it
    eagerly). The model gives `encoder_dtype`, `encoder_plan(grids, device)` and `encode_planned(pixels,
    plan)`, the last launching kernels only (no host-device copies, which a graph could not repeat)."""

    def __init__(self, model: Any, device: torch.device, policy: CapturePolicy):
        self.model, self.device, self.policy = model, device, policy
        self._graphs: dict[Grids, _Graph] = {}
        self._pool = torch.cuda.graph_pool_handle()
        self._stream: torch.cuda.Stream | None = None  # the captures' side stream, made at the first one

    def run(self, pixels: torch.Tensor, grids: list[tuple[int, int, int]]) -> torch.Tensor | None:
        key: Grids = tuple((int(t), int(h), int(w)) for t, h, w in grids)
        entry = self._graphs.get(key)
        if entry is None:
            if not self.policy.should_capture(key, pixels.shape[0]):
                return None
            start = time.perf_counter()
            try:
                entry = self._capture(key, pixels)
            except RuntimeError as error:  # a kernel that cannot be captured here: stay eager from now on
                logger.warning("the encoder's CUDA graph capture failed (%s); it runs eagerly from now on", error)
                self.policy.max_graphs = 0
                return None
            self._graphs[key] = entry
            self.policy.did_capture(key)
            # the request that brought this forward waited for the capture: its cost is worth seeing
            logger.info(
                "captured the encoder's CUDA graph %d of at most %d (%d items, %d patch rows) in %.0f ms",
                len(self._graphs),
                self.policy.max_graphs,
                len(key),
                pixels.shape[0],
                (time.perf_counter() - start) * 1e3,
            )
        entry.inputs.copy_(pixels)
        entry.graph.replay()
        return entry.output.clone()  # the next replay of any graph may reuse this memory

    def __len__(self) -> int:
        return len(self._graphs)

    def _capture(self, key: Grids, pixels: torch.Tensor) -> _Graph:
        plan = self.model.encoder_plan(list(key), self.device)
        inputs = torch.empty(pixels.shape, dtype=self.model.encoder_dtype, device=self.device)
        inputs.copy_(pixels)
        stream = self._stream = self._stream or torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):  # one eager forward first: kernels compiled, attention plans built
            self.model.encode_planned(inputs, plan)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        # The steps before left pinned transfer buffers for the collector: none is collected mid-capture.
        with gc_paused(collect=False):
            graph, output = capture_graph(
                lambda: self.model.encode_planned(inputs, plan), self._pool, stream, while_serving=True
            )
        return _Graph(graph, inputs, output, plan)
