"""Rotary position embedding (HF "rotate_half" layout) with the rope_scaling types Llama/Qwen2 use.

Positions are explicit per token ([T]), so a flattened batch of many requests at different offsets
needs no padding. The cos/sin table is built lazily on the device of the first call; a model looks
up its step's rows once (`cos_sin`) and every layer applies them (`apply_rotary`: on CUDA tensors one
Triton launch for q and k, `pagoda/kernels/rotary.py`; elsewhere `apply_rotary_reference`, the
kernel's reference).

Two variants some checkpoints need: partial rotary (only the first `rotary_dim` dims of each head
rotate, the rest pass through: Yuan2-M32 rotates 128 of 256), and `table_precision="bfloat16"`,
which reproduces reference code that builds the whole table in bfloat16 (Yuan2-M32's HF code rounds
inv_freq, the positions, the angles and cos/sin to bf16; positions above 256 are themselves rounded).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from pagoda.errors import ConfigError
from pagoda.kernels import dispatch


def rope_parameters(hf_config: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, scaling dict or None) from either the old or the transformers-5 config layout."""
    params = hf_config.get("rope_parameters") or {}
    theta = hf_config.get("rope_theta", params.get("rope_theta", 10000.0))
    scaling = hf_config.get("rope_scaling") or (params if params.get("rope_type", "default") != "default" else None)
    return float(theta), scaling


def _inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    # Built on the CPU explicitly: models are constructed under a meta-device context.
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float64, device="cpu") / head_dim
    inv_freq = 1.0 / (theta**exponents)
    if scaling is None:
        return inv_freq
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "llama3":
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_len = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        low_wavelen, high_wavelen = old_len / low, old_len / high
        smooth = (old_len / wavelen - low) / (high - low)
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        mid = (1 - smooth) * scaled / factor + smooth * scaled
        is_mid = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(is_mid, mid, scaled)
    raise ConfigError(f"rope_scaling type {kind!r} is not supported yet (supported: default, linear, llama3).")


class RotaryEmbedding(nn.Module):
    def __init__(
        self,
        rotary_dim: int,
        max_positions: int,
        theta: float,
        scaling: dict[str, Any] | None,
        table_precision: str = "float64",
    ):
        super().__init__()
        if table_precision not in ("float64", "bfloat16"):
            raise ConfigError(f"rope table precision must be float64 or bfloat16, got {table_precision!r}")
        self.rotary_dim = rotary_dim
        self.max_positions = max_positions
        self.table_precision = table_precision
        self._inv_freq = _inv_freq(rotary_dim, theta, scaling)
        self._cos_sin: torch.Tensor | None = None  # [max_positions, rotary_dim] cos | sin halves

    def _table(self, device: torch.device) -> torch.Tensor:
        if self._cos_sin is None or self._cos_sin.device != device:
            if self.table_precision == "bfloat16":
                # inv_freq computed in float32 then rounded; positions, angles, cos/sin all bf16.
                inv_freq = self._inv_freq.float().to(torch.bfloat16)
                t = torch.arange(self.max_positions, dtype=torch.bfloat16, device="cpu")
                freqs = torch.einsum("i,j->ij", t, inv_freq)
            else:
                t = torch.arange(self.max_positions, dtype=torch.float64, device="cpu")
                freqs = torch.outer(t, self._inv_freq)  # [P, R/2]
            self._cos_sin = torch.cat([freqs.cos(), freqs.sin()], -1).float().to(device)
        return self._cos_sin

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, 1, R/2] for these positions: computed once per step, shared by every layer."""
        cos, sin = self._table(positions.device)[positions].unsqueeze(1).chunk(2, dim=-1)
        return cos, sin


def multimodal_cos_sin(
    rotary: RotaryEmbedding, positions: torch.Tensor, sections: list[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """M-RoPE (Qwen2-VL): positions [3, T] (temporal, height, width); the first sections[0] frequency
    pairs rotate with the temporal position, the next sections[1] with the height, the rest with the
    width. Returns cos, sin [T, 1, R/2] like `cos_sin`; equal to it when all three rows agree."""
    table = rotary._table(positions.device)  # [P, R]: cos | sin halves
    half = table.shape[-1] // 2
    rows = table[positions]  # [3, T, R]
    cos_parts, sin_parts, lo = [], [], 0
    for axis, width in enumerate(sections):
        cos_parts.append(rows[axis, :, lo : lo + width])
        sin_parts.append(rows[axis, :, half + lo : half + lo + width])
        lo += width
    assert lo == half, f"mrope_section {sections} must sum to {half}"
    return torch.cat(cos_parts, -1).unsqueeze(1), torch.cat(sin_parts, -1).unsqueeze(1)


def apply_rotary(
    q: torch.Tensor, k: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, Hq, D], k [T, Hkv, D] rotated by the step's cos/sin [T, 1, R/2]. With R < D only the
    first R dims of each head rotate (partial rotary); the rest pass through unchanged.
    Returns new tensors; q and k may be strided views (e.g. splits of a fused qkv output)."""
    cos, sin = cos_sin
    ops = dispatch.fused_for("rotary", q)
    if ops is not None and ops.supports_rotary(q, k, cos, sin):
        return ops.rotary(q, k, cos, sin)
    return apply_rotary_reference(q, k, cos_sin)


def apply_rotary_reference(
    q: torch.Tensor, k: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """`apply_rotary` in PyTorch: fp32 math (x1·cos − x2·sin, x2·cos + x1·sin), rounded once to x.dtype."""
    cos, sin = cos_sin
    rotary_dim = 2 * cos.shape[-1]
    if rotary_dim == q.shape[-1]:
        return _rotate(q, cos, sin), _rotate(k, cos, sin)
    return _rotate_partial(q, cos, sin, rotary_dim), _rotate_partial(k, cos, sin, rotary_dim)


def _rotate_partial(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int) -> torch.Tensor:
    return torch.cat([_rotate(x[..., :rotary_dim], cos, sin), x[..., rotary_dim:]], dim=-1)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)
