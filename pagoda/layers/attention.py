"""Paged attention layer and the backend interface it calls.

A step's tokens arrive flattened: T tokens from B requests, no padding. `AttentionBatch` (built
once per step by the model runner) says where each request's queries start, how long its context
is, which KV blocks hold that context (block table) and which cache slot each new token's K/V goes
to (slot mapping). A backend turns it into whatever per-step metadata it wants once
(`prepare`), then every layer calls `forward` with that prepared object.

KV cache layout per layer: two tensors [num_blocks, block_size, num_kv_heads, head_dim]; token at
position p of a request lives in slot `block_table[p // block_size] * block_size + p % block_size`.
Block 0 is the null block: never handed to a request, used to pad block tables.

The cache is in the model's dtype, or (`--kv-cache-dtype fp8`) in e4m3 with one scale per tensor per
layer (`Attention.k_scale` / `v_scale`: 1.0, or the checkpoint's `k_scale` / `v_scale` through
`set_kv_scales`): stored q = e4m3(clamp(x / scale, ±448)), read x = float(q) * scale
(`quantize_kv` / `dequantize_kv`). A backend tells which by the cache tensors' dtype, and ignores
the scales for a cache of the model's dtype.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from pagoda.layers.rotary import apply_rotary
from pagoda.layers.sequence_state import SequenceStateBatch


@dataclass
class AttentionBatch:
    query_lens: list[int]  # [B] new tokens per request this step
    seq_lens: list[int]  # [B] context length after this step (cached + new)
    query_start_loc: torch.Tensor  # [B + 1] int64, offsets of each request in the flat token axis
    seq_lens_tensor: torch.Tensor  # [B] int64, same as seq_lens, on device
    block_tables: torch.Tensor  # [B, max_blocks] int64, padded with the null block 0
    slot_mapping: torch.Tensor  # [T] int64, cache slot for each new token's K/V
    block_size: int
    # Every row is one decode token attended exactly as a step of that row alone would attend it (a CPU
    # verification step's tokens run as decode rows: `worker/spec_rows.attention_batch`).
    rows_alone: bool = False

    @property
    def num_reqs(self) -> int:
        return len(self.query_lens)


FP8_KV = torch.float8_e4m3fn  # the fp8 cache's element type
FP8_KV_MAX = 448.0  # its largest finite value: stores saturate there


def quantize_kv(x: torch.Tensor, scale: float) -> torch.Tensor:
    """x (any float dtype) → the e4m3 values an fp8 cache stores: x / scale in fp32, clamped to ±448,
    rounded to nearest even. The reference the Triton stores match bit for bit.

    The divisor is a tensor on x's device: PyTorch's CUDA division by a Python (CPU) scalar multiplies by
    the scalar's reciprocal, which is off by one fp32 ulp on some quotients — enough to move a value near
    an e4m3 rounding tie to the neighbouring step. A device tensor divides with IEEE rounding everywhere."""
    divisor = torch.tensor(scale, dtype=torch.float32, device=x.device)
    return (x.float() / divisor).clamp(-FP8_KV_MAX, FP8_KV_MAX).to(FP8_KV)


def dequantize_kv(q: torch.Tensor, scale: float, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """What stored e4m3 values stand for: float(q) * scale (in fp32), as `dtype`."""
    return (q.float() * scale).to(dtype)


class AttentionBackend(ABC):
    """One implementation of paged attention (PyTorch reference on CPU, Triton on GPU)."""

    name: str
    # Whether cache slots past a request's length must hold finite values (the model runner then
    # zeroes every block it hands out). A backend whose kernels never load those slots sets False
    # and saves the zeroing: two launches per layer in almost every serving step.
    needs_zeroed_blocks: bool = True

    def warm_up(  # noqa: B027  (an optional hook: a backend with nothing to compile keeps this no-op)
        self,
        shapes: set[tuple[int, int, int]],
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
        cache_dtype: torch.dtype | None = None,
    ) -> None:
        """Called once at start-up with every (num_heads, num_kv_heads, head_dim) the model's
        attention layers use, and the cache's dtype (None: dtype): a backend that compiles kernels on
        first use compiles them here."""

    @abstractmethod
    def prepare(self, batch: AttentionBatch) -> Any:
        """Per-step metadata shared by all layers (computed once, not per layer)."""

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        metadata: Any,
        scale: float,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
    ) -> torch.Tensor:
        """Store k/v [T, Hkv, D] into the cache, then attend q [T, Hq, D] → [T, Hq, D]. k_scale/v_scale:
        an fp8 cache's per-tensor scales (see the module docstring)."""

    def forward_rotary(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        metadata: Any,
        scale: float,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
    ) -> torch.Tensor:
        """`forward` of q and k rotated by cos_sin (`apply_rotary`). Backends that fold the rotation
        into their KV store (one launch fewer per layer) override this."""
        q, k = apply_rotary(q, k, cos_sin)
        return self.forward(q, k, v, k_cache, v_cache, metadata, scale, k_scale, v_scale)


@dataclass
class StepAttention:
    """What a model's forward receives besides token ids and positions: the attention backend and its
    prepared per-step metadata, plus what only some models use — for per-sequence recurrent state
    (Yuan2's LF gate) where each row's state slot is; for multimodal models (Qwen2-VL) the M-RoPE
    positions and the encoder outputs that replace placeholder-token embeddings."""

    backend: AttentionBackend
    metadata: Any
    state: SequenceStateBatch | None = None
    mrope_positions: torch.Tensor | None = None  # [3, T] (t, h, w) positions; None = 1-D positions
    mm_embeds: tuple[torch.Tensor, torch.Tensor] | None = None  # flat token index [K], embeddings [K, H]
    # A pipeline stage after the first starts from the previous stage's (layer output, residual), each [T, H].
    stage_input: tuple[torch.Tensor, torch.Tensor] | None = None


class Attention(nn.Module):
    """Holds this layer's KV cache views (bound by the worker), its fp8 cache scales, and dispatches
    to the backend."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float | None = None):
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale if scale is not None else head_dim**-0.5
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)
        # Per-tensor scales of an fp8 cache: plain floats, fixed after loading (kernel scalars, which
        # a captured CUDA graph keeps); 1.0 unless the checkpoint has k_scale / v_scale.
        self.k_scale = 1.0
        self.v_scale = 1.0

    def bind_kv_cache(self, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
        self.k_cache, self.v_cache = k_cache, v_cache

    def set_kv_scales(self, k_scale: float, v_scale: float) -> None:
        """The checkpoint's KV-cache scales (the loader calls this); used only by an fp8 cache."""
        if not (k_scale > 0 and v_scale > 0 and math.isfinite(k_scale) and math.isfinite(v_scale)):
            raise ValueError(f"KV cache scales must be positive and finite, got k={k_scale}, v={v_scale}")
        self.k_scale, self.v_scale = float(k_scale), float(v_scale)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        attn: StepAttention,
        rope: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """q [T, Hq * D] (or [T, Hq, D]), k/v [T, Hkv * D] (or [T, Hkv, D]) → [T, Hq * D]. With rope
        (the step's cos/sin) q and k are rotated first: by the backend, inside its KV store where it can."""
        t = q.shape[0]
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        caches = (self.k_cache, self.v_cache, attn.metadata, self.scale, self.k_scale, self.v_scale)
        if rope is None:
            out = attn.backend.forward(q, k, v, *caches)
        else:
            out = attn.backend.forward_rotary(q, k, v, rope, *caches)
        return out.reshape(t, self.num_heads * self.head_dim)
