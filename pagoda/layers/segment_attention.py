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

A thread may pin one backend for its tower forwards (`pinned_backend`): the encoder's CUDA graphs are captured on
a thread of their own, which builds cuDNN's plans there (PyTorch keeps them per thread), while the engine's thread
runs the same shapes through flash until the graph is ready. A pinned thread's passes are not counted.

The chosen kernel is called directly (`_attend`), not through SDPA's backend switches (`sdpa_kernel`): those are
process-wide flags, which two threads choosing differently would race on (one thread's choice, or its restore
on leaving the block, landing in the other's call).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
from collections.abc import Iterator

import torch
import torch.nn.functional as F

from pagoda import envs

logger = logging.getLogger(__name__)


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
_PINNED = threading.local()  # .cudnn: None (the gate decides), True or False, for this thread's forwards


def begin_pass() -> None:
    """A new forward of the tower: the shared gate counts each shape it meets once from here on."""
    if getattr(_PINNED, "cudnn", None) is None:
        _GATE.begin_pass()


def cudnn_allowed() -> bool:
    """Whether the tower may take cuDNN at all (`PAGODA_VISION_CUDNN_AFTER` is not 0)."""
    return _GATE.after != 0


@contextlib.contextmanager
def pinned_backend(cudnn: bool) -> Iterator[None]:
    """This thread's tower forwards inside the block take cuDNN (True) or flash (False), whatever the gate says,
    and leave its counts alone."""
    previous = getattr(_PINNED, "cudnn", None)
    _PINNED.cudnn = cudnn
    try:
        yield
    finally:
        _PINNED.cudnn = previous


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
    cudnn = getattr(_PINNED, "cudnn", None)
    if cudnn is None:  # the gate decides; cuDNN's plans are keyed by shapes and strides
        cudnn = (gate or _GATE).use_cudnn((*q.shape, q.dtype, q.stride(), k.stride(), v.stride()))
    return _attend(q, k, v, cudnn)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cudnn: bool) -> torch.Tensor:
    """cuDNN's or FlashAttention's kernel (the ops SDPA itself dispatches to: the same bits), or SDPA's own choice
    for inputs neither takes (float32, a head dim flash has no kernel for, a strided last dimension) and, should a
    direct call ever be refused (a PyTorch whose op differs), from then on."""
    global _DIRECT_REFUSED
    d = q.shape[-1]
    if q.dtype not in (torch.float16, torch.bfloat16) or d % 8 or d > 128 or min(t.stride(-1) for t in (q, k, v)) != 1:
        return F.scaled_dot_product_attention(q, k, v)
    if not _DIRECT_REFUSED:
        try:
            if cudnn:
                return torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, False)[0]
            return torch.ops.aten._scaled_dot_product_flash_attention(q, k, v)[0]
        except (RuntimeError, TypeError) as error:
            logger.warning("the vision attention's direct kernel call failed (%s); SDPA chooses from now on", error)
            _DIRECT_REFUSED = True
    return F.scaled_dot_product_attention(q, k, v)


_DIRECT_REFUSED = False
