"""Non-causal attention over stacked equal-length segments (the vision tower's images), with SDPA's backend
chosen per shape so that a shape met once does not stall the engine's thread on a cuDNN plan build.

On Hopper, PyTorch's SDPA prefers cuDNN for these shapes: the fastest kernel once built, but the first call of
every new [n, heads, L, head_dim] builds an execution plan on the calling thread, which compiles a kernel with
NVRTC (tens of ms, during which the engine launches nothing). The tower meets a new shape whenever a step brings
a new count n of images of one size, or a new size: with the sizes real traffic sends, most shapes are rare.
FlashAttention (SDPA's flash backend) has no per-shape plan and costs more GPU time per call. `ShapeGate` sends a
shape to cuDNN from the `after`-th tower pass that meets it on (the build is paid once, by a shape that keeps
coming back); the passes before run it through flash. A pass is one forward of the tower (`begin_pass`): its
layers all call the same shapes, so counting calls instead would reach any threshold within the first forward.
`PAGODA_VISION_CUDNN_AFTER` sets `after` (1: cuDNN from the first call, PyTorch's own choice; 0: never cuDNN).
"""

from __future__ import annotations

import functools
import inspect

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from pagoda import envs

_FLASH_FIRST = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
_CUDNN_FIRST = [SDPBackend.CUDNN_ATTENTION, *_FLASH_FIRST]
# `set_priority` (newer PyTorch) makes SDPA try the list in its order; without it the list only says which
# backends are allowed and SDPA's own order applies among them (cuDNN first on Hopper since PyTorch 2.5).
_ORDERED = "set_priority" in inspect.signature(sdpa_kernel).parameters


class ShapeGate:
    """Counts, per shape, the passes that met it; `use_cudnn(shape)` says whether this call may take (and build)
    cuDNN. A shape counts once per pass, however many layers call it."""

    def __init__(self, after: int):
        self.after = after
        self._pass = 0
        self._seen: dict[tuple, tuple[int, int]] = {}  # shape -> (passes that met it, capped at `after`; last pass)

    def begin_pass(self) -> None:
        self._pass += 1

    def use_cudnn(self, shape: tuple) -> bool:
        if self.after <= 1:
            return self.after == 1
        passes, last = self._seen.get(shape, (0, -1))
        if last != self._pass and passes < self.after:  # a shape past its threshold stays there
            passes += 1
            self._seen[shape] = (passes, self._pass)
        return passes >= self.after


_GATE = ShapeGate(envs.VISION_CUDNN_AFTER.value)


def begin_pass() -> None:
    """A new forward of the tower: the shared gate counts each shape it meets once from here on."""
    _GATE.begin_pass()


@functools.cache
def _hopper_or_later(device: torch.device) -> bool:
    return torch.cuda.get_device_capability(device)[0] >= 9


def _gated(q: torch.Tensor) -> bool:
    """Whether SDPA would pick cuDNN for q here (a CUDA device of compute capability 9 or later, cuDNN SDPA on).
    Asked by every layer of every forward: the device's capability is looked up once."""
    return q.is_cuda and torch.backends.cuda.cudnn_sdp_enabled() and _hopper_or_later(q.device)


def segment_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gate: ShapeGate | None = None) -> torch.Tensor:
    """softmax(q kᵀ / sqrt(d)) v over [n, heads, L, d] (no mask): n segments of L rows each."""
    if not _gated(q):
        return F.scaled_dot_product_attention(q, k, v)
    shape = (*q.shape, q.dtype, q.stride(), k.stride(), v.stride())  # cuDNN's plans are keyed by shapes and strides
    backends = _CUDNN_FIRST if (gate or _GATE).use_cudnn(shape) else _FLASH_FIRST
    with sdpa_kernel(backends, set_priority=True) if _ORDERED else sdpa_kernel(backends):
        return F.scaled_dot_product_attention(q, k, v)
