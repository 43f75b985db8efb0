"""`--cpu-offload-gb G`: about G GiB of a rank's decoder-layer weights live in host memory and are copied to
the GPU as their layer comes up, so a model slightly too large for one card still runs on it.

Which layers: the fewest whole decoder layers whose weights reach G, spread evenly through the stack
(`choose_layers`), so between two offloaded layers there are resident ones whose compute hides the next
copy. How: every offloaded layer's parameters alias one of two GPU staging slots (offloaded layers take
them in turn); the host copies are pinned, so a copy runs on its own CUDA stream beside the compute.
Before an offloaded layer runs, the compute stream waits for its copy; as it starts, the next offloaded
layer's copy is queued into the other slot, once the layer that used that slot last has finished (an event
recorded after it). When the next layer would need the running layer's own slot (an odd number of offloaded
layers wraps around to the first), that copy is queued after the running layer instead.

A step therefore reads the offloaded weights over the host link once: at ~25 GB/s for PCIe 4 x16, 1 GiB
costs ~43 ms per step, hidden only as far as the resident layers' compute lasts. The KV cache grows by
what was offloaded (the memory profile runs after the weights moved). Steps run eagerly (no CUDA graphs:
the copies, not the launches, bound a step). On a CPU the weights are in host memory already: the flag is
refused there; the same code runs there in the tests with plain copies.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence

import torch
from torch import nn

logger = logging.getLogger(__name__)

HOST_LINK_BYTES_PER_S = 25e9  # PCIe 4 x16, as the startup log's estimate


def layer_bytes(layer: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in layer.parameters())


def choose_layers(sizes: Sequence[int], budget_bytes: int) -> list[int]:
    """Indices (into `sizes`) of the fewest layers whose bytes reach `budget_bytes`, evenly spaced: the
    k chosen of n sit at the middles of k equal parts of the stack. All of them when the budget exceeds
    the total; none for a budget of 0."""
    n = len(sizes)
    if budget_bytes <= 0 or n == 0:
        return []
    mean = sum(sizes) / n
    k = min(n, math.ceil(budget_bytes / mean)) if mean else 0
    return sorted({min(n - 1, int((i + 0.5) * n / k)) for i in range(k)})


class WeightStreamer:
    """Moves the chosen layers' weights to host memory and streams them back through two GPU slots."""

    def __init__(self, layers: Sequence[nn.Module], device: torch.device):
        self.layers = list(layers)
        self.device = device
        cuda = device.type == "cuda"
        shapes = [[(p.shape, p.dtype) for p in layer.parameters()] for layer in self.layers]
        if any(s != shapes[0] for s in shapes):
            raise ValueError("the offloaded layers differ in their parameters' shapes")
        self.params = [list(layer.parameters()) for layer in self.layers]
        self.host = [
            [torch.empty(p.shape, dtype=p.dtype, pin_memory=cuda).copy_(p.data) for p in ps] for ps in self.params
        ]
        count = 1 if len(self.layers) == 1 else 2
        self.slots = [
            [torch.empty(p.shape, dtype=p.dtype, device=device) for p in self.params[0]] for _ in range(count)
        ]
        for order, ps in enumerate(self.params):
            for p, buffer in zip(ps, self.slots[self.slot(order)], strict=True):
                p.data = buffer  # the GPU copy is dropped here; the layer reads whatever its slot holds
        self.stream = torch.cuda.Stream(device) if cuda else None
        self.copied: list[torch.cuda.Event | bool | None] = [None] * len(self.layers)  # a queued copy per layer
        self.released: list[torch.cuda.Event | None] = [None] * len(self.slots)  # each slot's last user done
        for order, layer in enumerate(self.layers):
            layer.register_forward_pre_hook(lambda module, args, order=order: self._before(order))
            layer.register_forward_hook(lambda module, args, out, order=order: self._after(order))

    def slot(self, order: int) -> int:
        return order % len(self.slots)

    @property
    def host_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for ts in self.host for t in ts)

    def _queue_copy(self, order: int) -> None:
        """Copy layer `order`'s weights into its slot once the slot's last user is done (on the copy stream)."""
        slot = self.slot(order)
        if self.stream is None:  # CPU (tests): a plain copy, in order
            for dst, src in zip(self.slots[slot], self.host[order], strict=True):
                dst.copy_(src)
            self.copied[order] = True
            return
        with torch.cuda.stream(self.stream):
            if self.released[slot] is not None:
                self.stream.wait_event(self.released[slot])
            for dst, src in zip(self.slots[slot], self.host[order], strict=True):
                dst.copy_(src, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.stream)
        self.copied[order] = event

    def _before(self, order: int) -> None:
        if self.copied[order] is None:  # the first step, or a copy not queued ahead
            self._queue_copy(order)
        done = self.copied[order]
        if isinstance(done, torch.cuda.Event):
            torch.cuda.current_stream(self.device).wait_event(done)
        self.copied[order] = None
        upcoming = (order + 1) % len(self.layers)
        if self.slot(upcoming) != self.slot(order) and self.copied[upcoming] is None:
            self._queue_copy(upcoming)  # overlaps this layer and the resident ones after it

    def _after(self, order: int) -> None:
        slot = self.slot(order)
        if self.stream is not None:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.device))
            self.released[slot] = event
        upcoming = (order + 1) % len(self.layers)
        if self.slot(upcoming) == slot and self.copied[upcoming] is None:
            self._queue_copy(upcoming)  # it needed this layer's own slot: only now is the slot free


def offload_layers(layers: Sequence[nn.Module], budget_gib: float, device: torch.device) -> WeightStreamer | None:
    """Offload about `budget_gib` of these layers' weights (None when the budget is 0); logs what moved."""
    chosen = choose_layers([layer_bytes(layer) for layer in layers], int(budget_gib * 2**30))
    if not chosen:
        return None
    streamer = WeightStreamer([layers[i] for i in chosen], device)
    moved = streamer.host_bytes
    logger.info(
        "CPU offload: %d of %d decoder layers (%.2f GiB, layers %s) in %s host memory; each step copies them back "
        "(~%.0f ms at %.0f GB/s), hidden behind the other layers' compute as far as it lasts",
        len(chosen),
        len(layers),
        moved / 2**30,
        ", ".join(str(i) for i in chosen),
        "pinned" if device.type == "cuda" else "plain",
        moved / HOST_LINK_BYTES_PER_S * 1e3,
        HOST_LINK_BYTES_PER_S / 1e9,
    )
    return streamer
