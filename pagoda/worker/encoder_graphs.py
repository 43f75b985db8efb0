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

Where the capture runs: on a thread of its own (`PAGODA_ENCODER_CAPTURE_THREAD`, the default). A capture is an
eager forward (which builds cuDNN's attention plan for the key's shapes: an NVRTC compile) and the capture
itself, hundreds of ms of host time in all; on the engine's thread the request whose forward met the key would
wait for it, and every running stream with it. The engine's thread hands over the key's plan (made on its own
stream, with an event the capture stream waits for) and keeps running that key eagerly, on FlashAttention
(`layers/segment_attention.pinned_backend`: no plan build on its thread), until the graph is ready; the capture
thread runs with cuDNN pinned, so the plans it builds stay in its own thread's cache, and its captures are
`thread_local`, so the engine's CUDA calls meanwhile are legal. One thing stays process-wide: while a capture is
open, torch holds its default CUDA generator in capture mode, and a draw from it on another stream raises, so
nothing on the engine's thread may draw from it (sampling uses `SamplingState.generator`). 0 captures inline,
inside the step.

The switch is `PAGODA_ENCODER_GRAPH_PATCHES` (0: always eager); `--enforce-eager` turns it off too.
"""

from __future__ import annotations

import contextlib
import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from pagoda.layers.segment_attention import cudnn_allowed, pinned_backend
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
    """`encode(pixels, grids)`: the encoder's output, from a graph of that key where one is held, else from an
    eager forward. The model gives `encode`, `encoder_dtype`, `encoder_plan(grids, device)` and
    `encode_planned(pixels, plan)`, the last launching kernels only (no host-device copies, which a graph could
    not repeat)."""

    def __init__(self, model: Any, device: torch.device, policy: CapturePolicy, background: bool = True):
        self.model, self.device, self.policy = model, device, policy
        self._graphs: dict[Grids, _Graph] = {}
        self._pending: dict[Grids, tuple[Future, float]] = {}  # key -> (its capture, when it was handed over)
        self._pool = torch.cuda.graph_pool_handle()
        self._stream: torch.cuda.Stream | None = None  # the captures' side stream, made at the first one
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="encoder-graphs") if background else None

    def encode(self, pixels: torch.Tensor, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        key: Grids = tuple((int(t), int(h), int(w)) for t, h, w in grids)
        if self._pending:
            self._collect()
        entry = self._graphs.get(key)
        if entry is None and key not in self._pending and self.policy.should_capture(key, pixels.shape[0]):
            entry = self._start_capture(key, pixels)
        if entry is None:
            if key in self._pending:  # its graph is on the way: no cuDNN plan build on this thread meanwhile
                with pinned_backend(cudnn=False):
                    return self.model.encode(pixels, grids)
            return self.model.encode(pixels, grids)
        entry.inputs.copy_(pixels)
        entry.graph.replay()
        return entry.output.clone()  # the next replay of any graph may reuse this memory

    def wait(self) -> None:
        """Let every capture handed to the capture thread finish and join the table (for tests)."""
        for future, _ in list(self._pending.values()):
            future.exception()
        self._collect()

    def __len__(self) -> int:
        return len(self._graphs)

    def _start_capture(self, key: Grids, pixels: torch.Tensor) -> _Graph | None:
        """Capture `key` now (inline: its graph, or None where the capture failed) or hand it to the capture
        thread (None: this forward runs eagerly)."""
        self.policy.did_capture(key)  # counted from now on, so the graph count holds with captures in flight
        start = time.perf_counter()
        plan = self.model.encoder_plan(list(key), self.device)
        if self._worker is None:
            try:
                entry = self._capture(key, plan, pixels.shape)
            except RuntimeError as error:
                self._give_up(error)
                return None
            self._done(key, entry, start, "")
            return entry
        ready = torch.cuda.Event()
        ready.record()  # the plan's copies, queued on this thread's stream
        self._pending[key] = (self._worker.submit(self._capture, key, plan, pixels.shape, ready), start)
        return None

    def _collect(self) -> None:
        for key, (future, start) in list(self._pending.items()):
            if not future.done():
                continue
            del self._pending[key]
            error = future.exception()
            if error is None:
                self._done(key, future.result(), start, " on the capture thread")
            else:  # whatever went wrong there, the engine serves on eagerly
                self._give_up(error)

    def _done(self, key: Grids, entry: _Graph, start: float, where: str) -> None:
        self._graphs[key] = entry
        # inline, the request that brought this forward waited for the capture: its cost is worth seeing
        logger.info(
            "captured the encoder's CUDA graph %d of at most %d (%d items, %d patch rows) in %.0f ms%s",
            len(self._graphs),
            self.policy.max_graphs,
            len(key),
            entry.inputs.shape[0],
            (time.perf_counter() - start) * 1e3,
            where,
        )

    def _give_up(self, error: BaseException) -> None:
        # a kernel that cannot be captured here: stay eager from now on
        logger.warning("the encoder's CUDA graph capture failed (%s); it runs eagerly from now on", error)
        self.policy.max_graphs = 0

    def _capture(self, key: Grids, plan: Any, shape: torch.Size, ready: torch.cuda.Event | None = None) -> _Graph:
        """One eager forward (kernels compiled, attention plans built), then the capture, on the side stream; on
        the capture thread (`ready`: the event after the plan's copies) or inline."""
        with torch.cuda.device(self.device), torch.inference_mode(), self._backend(ready is not None):
            stream = self._stream = self._stream or torch.cuda.Stream(self.device)
            if ready is None:
                stream.wait_stream(torch.cuda.current_stream())
            else:
                stream.wait_event(ready)
            with torch.cuda.stream(stream):
                inputs = torch.zeros(shape, dtype=self.model.encoder_dtype, device=self.device)
                self.model.encode_planned(inputs, plan)
            # The steps before left pinned transfer buffers for the collector: none is collected mid-capture.
            with gc_paused(collect=False):
                graph, output = capture_graph(
                    lambda: self.model.encode_planned(inputs, plan), self._pool, stream, while_serving=True
                )
            if ready is None:
                torch.cuda.current_stream().wait_stream(stream)
            else:  # replays run on the engine's stream, after it copies pixels into `inputs`
                stream.synchronize()
        return _Graph(graph, inputs, output, plan)

    @staticmethod
    def _backend(on_capture_thread: bool) -> Any:
        """The capture thread pins cuDNN (its plans are built there, off the engine's thread); inline, the gate
        decides as for any forward."""
        if on_capture_thread and cudnn_allowed():
            return pinned_backend(cudnn=True)
        return contextlib.nullcontext()
