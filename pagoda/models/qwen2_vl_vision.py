"""Qwen2-VL vision tower (as transformers' Qwen2VisionTransformer): patch embed, 2-D rotary ViT blocks,
2×2 patch merger.

Input is the processor's patch matrix (`pixel_values`, one row per 14×14×2 patch, rows in
merge-window order) plus one `(t, h, w)` grid per item; output is one row per LLM placeholder
token (`t·h·w / merge²` rows per item, items in order). Parameter names match the checkpoint keys
under `visual.` so the generic loader maps them one to one; the only reshaping is the Conv3d patch
embedding, which `PatchEmbedLinear.weight_loader` flattens (kernel = stride = input, so the conv is
exactly a matmul).

Attention is block-diagonal and non-causal: one segment per (item, temporal patch). There is no
varlen kernel on every device we run on, so segments of equal length (same-size images, the frame
pairs of one video) are stacked and sent to one SDPA call each (`layers.segment_attention`, which keeps
shapes met rarely off cuDNN's per-shape plan builds). The tower runs its rows grouped by segment length
(`SegmentLayout`: one gather in, one out, when the items' sizes are interleaved), so that each group is a
contiguous slice of every layer's activations: a view into SDPA, not a gather and a scatter per layer.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from pagoda.device_copy import to_device
from pagoda.errors import ModelLoadError
from pagoda.layers.activation import quick_gelu
from pagoda.layers.linear import Linear
from pagoda.layers.norm import LayerNorm
from pagoda.layers.rotary import apply_rotary
from pagoda.layers.segment_attention import begin_pass, segment_attention

Grid = tuple[int, int, int]

# Defaults of the official checkpoints (docs/models.md, Qwen2-VL: the vision tower's defaults): most
# config.json files only carry hidden_size, in_chans and spatial_patch_size, and the HF class default for
# hidden_size (3584) is wrong for 2B/72B.
_VISION_DEFAULTS: dict[str, Any] = {
    "depth": 32,
    "embed_dim": 1280,
    "num_heads": 16,
    "mlp_ratio": 4,
    "patch_size": 14,
    "temporal_patch_size": 2,
    "spatial_merge_size": 2,
    "in_channels": 3,
    "hidden_act": "quick_gelu",
}
# Older spellings some checkpoints use -> our canonical key.
_ALIASES = {"spatial_patch_size": "patch_size", "in_chans": "in_channels"}
_LAYER_NORM_EPS = 1e-6  # hard-coded in the reference implementation
_ROPE_THETA = 10000.0
ROPE_CACHE_SIZES = 64  # (h, w) rotary tables the tower keeps (LRU)


_ACTIVATIONS = {"quick_gelu": quick_gelu, "gelu": F.gelu, "silu": F.silu}


def vision_config_with_defaults(vision_cfg: dict[str, Any], text_hidden: int) -> dict[str, Any]:
    """A complete vision config: aliases resolved, missing fields from the checkpoint defaults.

    `hidden_size` (the merger's output width) must be the LLM hidden size since merged rows are
    scattered straight into the token embeddings; a mismatch means a broken config.json.
    """
    cfg = dict(vision_cfg)
    for alias, canonical in _ALIASES.items():
        if alias in cfg and canonical not in cfg:
            cfg[canonical] = cfg[alias]
    for key, value in _VISION_DEFAULTS.items():
        if cfg.get(key) is None:
            cfg[key] = value
    if cfg.get("hidden_size") is None:
        cfg["hidden_size"] = text_hidden
    elif int(cfg["hidden_size"]) != int(text_hidden):
        raise ModelLoadError(
            f"vision_config.hidden_size ({cfg['hidden_size']}) must equal the language model's hidden_size "
            f"({text_hidden}): the vision merger's output rows replace token embeddings. "
            "Fix config.json (or drop vision_config.hidden_size to use the text hidden size)."
        )
    _validate(cfg)
    return cfg


def _validate(cfg: dict[str, Any]) -> None:
    """Reject shapes the ViT cannot run, at load time rather than deep inside a forward pass."""
    if cfg["embed_dim"] % cfg["num_heads"]:
        raise ModelLoadError(f"vision embed_dim {cfg['embed_dim']} is not divisible by num_heads {cfg['num_heads']}.")
    if (cfg["embed_dim"] // cfg["num_heads"]) % 4:
        raise ModelLoadError(
            "vision head dim must be divisible by 4 (2-D rotary splits it into row/col halves); "
            f"got {cfg['embed_dim'] // cfg['num_heads']}."
        )
    if cfg["hidden_act"] not in _ACTIVATIONS:
        raise ModelLoadError(
            f"vision hidden_act {cfg['hidden_act']!r} is not supported (supported: {', '.join(sorted(_ACTIVATIONS))})."
        )


def split_by_item(
    features: torch.Tensor, grid_thw: Sequence[Grid] | torch.Tensor, merge_size: int = 2
) -> list[torch.Tensor]:
    """Per-item row blocks of the merged output: each item owns t·h·w/merge² consecutive rows."""
    sizes = [t * h * w // (merge_size * merge_size) for t, h, w in _as_grids(grid_thw)]
    return list(features.split(sizes, dim=0))


def _as_grids(grid_thw: Sequence[Sequence[int]] | torch.Tensor) -> list[Grid]:
    rows = grid_thw.tolist() if isinstance(grid_thw, torch.Tensor) else grid_thw
    return [(int(t), int(h), int(w)) for t, h, w in rows]


class PatchEmbedLinear(Linear):
    """The Conv3d patch embedding held as a [embed_dim, C·T·p·p] Linear (no bias).

    Checkpoints store the conv weight [embed_dim, C, T, p, p]; flattening it row-major gives the
    column order ((c·T + τ)·p + y)·p + x, which is exactly the processor's layout of a patch row.
    """

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        flat = loaded.reshape(loaded.shape[0], -1) if loaded.dim() > 2 else loaded
        if flat.shape != param.shape:
            raise ValueError(
                f"shape mismatch: patch embedding {tuple(param.shape)} vs checkpoint {tuple(loaded.shape)}"
            )
        param.data.copy_(flat)


class PatchEmbed(nn.Module):
    def __init__(self, in_features: int, embed_dim: int):
        super().__init__()
        self.proj = PatchEmbedLinear(in_features, embed_dim, bias=False)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        # [P, C·T·p·p] -> [P, D]; the processor hands float32, the weights may be bf16.
        return self.proj(pixel_values.to(self.proj.weight.dtype))


class VisionAttention(nn.Module):
    def __init__(self, dim: int, num_heads: int):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.qkv = Linear(dim, 3 * dim, bias=True)
        self.proj = Linear(dim, dim, bias=True)

    def forward(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], groups: list[tuple[int, int, int]]
    ) -> torch.Tensor:
        p = x.shape[0]
        # [P, 3·D] -> three [P, heads, d_h], heads contiguous inside each third
        q, k, v = self.qkv(x).view(p, 3, self.num_heads, self.head_dim).unbind(dim=1)
        # The LLM's rotate-half RoPE with per-patch tables (fp32 math, rounded once): one Triton launch
        # for q and k on CUDA, straight from the strided views of the fused projection.
        q, k = apply_rotary(q, k, rope)
        out = _segment_attention(q, k, v, groups)
        return self.proj(out.reshape(p, -1))


def _segment_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, groups: list[tuple[int, int, int]]
) -> torch.Tensor:
    """Non-causal attention inside each segment; one SDPA call per group of equal-length segments.

    `groups` holds (L, n, first row) per run of n segments of L rows that are contiguous in the rows of q, k, v
    (`SegmentLayout`), which cover them all in order.
    """
    if len(groups) == 1:
        length, n, _ = groups[0]
        return _batched_sdpa(q, k, v, n, length)
    parts = []
    for length, n, first in groups:
        rows = slice(first, first + n * length)
        parts.append(_batched_sdpa(q[rows], k[rows], v[rows], n, length))
    return torch.cat(parts)


def _batched_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, n: int, length: int) -> torch.Tensor:
    # [n·L, heads, d_h] -> [n, heads, L, d_h] -> SDPA -> back to [n·L, heads, d_h]
    def to_batch(t: torch.Tensor) -> torch.Tensor:
        return t.reshape(n, length, t.shape[1], t.shape[2]).transpose(1, 2)

    out = segment_attention(to_batch(q), to_batch(k), to_batch(v))
    return out.transpose(1, 2).reshape(n * length, q.shape[1], q.shape[2])


class VisionMLP(nn.Module):
    def __init__(self, dim: int, hidden: int, act: str):
        super().__init__()
        self.fc1 = Linear(dim, hidden, bias=True)
        self.fc2 = Linear(hidden, dim, bias=True)
        self.act = _ACTIVATIONS[act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class VisionBlock(nn.Module):
    """Pre-norm ViT block: x + Attn(LN1(x)), then x + MLP(LN2(x)).

    Each residual add is done by the LayerNorm that follows it (`layers.norm.LayerNorm` with a residual: one
    launch on CUDA): the block takes the previous block's MLP output still to be added (`pending`; None for the
    first block) and returns its own, which the next block's LN1 or the merger's norm adds. The sums are the
    reference's, in its order, each rounded once to the activation dtype."""

    def __init__(self, dim: int, num_heads: int, mlp_hidden: int, act: str):
        super().__init__()
        self.norm1 = LayerNorm(dim, eps=_LAYER_NORM_EPS)
        self.norm2 = LayerNorm(dim, eps=_LAYER_NORM_EPS)
        self.attn = VisionAttention(dim, num_heads)
        self.mlp = VisionMLP(dim, mlp_hidden, act)

    def forward(
        self,
        x: torch.Tensor,
        pending: torch.Tensor | None,
        rope: tuple[torch.Tensor, torch.Tensor],
        groups: list[tuple[int, int, int]],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(residual stream x, the MLP output to add to it next) for the stream x + pending."""
        if pending is None:
            h = self.norm1(x)
        else:
            h, x = self.norm1(pending, residual=x)  # x + pending, normed
        h, x = self.norm2(self.attn(h, rope, groups), residual=x)
        return x, self.mlp(h)


class PatchMerger(nn.Module):
    """LayerNorm every patch, then fold each 2×2 window (4 consecutive rows) into one LLM token."""

    def __init__(self, dim: int, out_dim: int, merge_size: int):
        super().__init__()
        self.window_dim = dim * merge_size * merge_size
        self.ln_q = LayerNorm(dim, eps=_LAYER_NORM_EPS)
        # nn.Sequential so checkpoint keys `mlp.0.*` / `mlp.2.*` map; index 1 is the (exact) GELU.
        self.mlp = nn.Sequential(
            Linear(self.window_dim, self.window_dim, bias=True), nn.GELU(), Linear(self.window_dim, out_dim, bias=True)
        )

    def forward(self, x: torch.Tensor, pending: torch.Tensor | None = None) -> torch.Tensor:
        # [P, D] (the stream x + pending) -> [P/m², m²·D] -> [P/m², H]
        normed = self.ln_q(x) if pending is None else self.ln_q(pending, residual=x)[0]
        return self.mlp(normed.reshape(-1, self.window_dim))


class Qwen2VisionTransformer(nn.Module):
    """The whole tower; construct with a config from `vision_config_with_defaults`."""

    def __init__(self, cfg: dict[str, Any]):
        super().__init__()
        dim, patch, temporal = cfg["embed_dim"], cfg["patch_size"], cfg["temporal_patch_size"]
        self.merge_size = cfg["spatial_merge_size"]
        self.head_dim = dim // cfg["num_heads"]
        self.patch_embed = PatchEmbed(cfg["in_channels"] * temporal * patch * patch, dim)
        mlp_hidden = int(dim * cfg["mlp_ratio"])
        self.blocks = nn.ModuleList(
            VisionBlock(dim, cfg["num_heads"], mlp_hidden, cfg["hidden_act"]) for _ in range(cfg["depth"])
        )
        self.merger = PatchMerger(dim, cfg["hidden_size"], self.merge_size)
        # (h, w, device) -> float32 (cos, sin) [h·w, 1, d_h/2]; a plain dict, not buffers, so that
        # meta-device construction and `.to(dtype)` leave it alone. Least recently used first, at most
        # ROPE_CACHE_SIZES entries: real traffic brings many image sizes, each ~0.6 MB at 1000x750.
        self._rope_cache: OrderedDict[tuple[int, int, torch.device], tuple[torch.Tensor, torch.Tensor]] = OrderedDict()

    def forward(self, pixel_values: torch.Tensor, grid_thw: Sequence[Grid] | torch.Tensor) -> torch.Tensor:
        """[P, C·T·p·p] patches of all items -> [P/merge², hidden] merged rows, items in order."""
        grids = _as_grids(grid_thw)
        self._check_input(pixel_values, grids)
        return self.run(pixel_values, self.plan(grids, pixel_values.device))

    def plan(self, grids: list[Grid], device: torch.device) -> TowerPlan:
        """Everything a forward over these items needs beside the pixels, on `device`: the order of its rows and
        its rotary tables. `run` then only launches kernels (no host-device copies), which is what a CUDA graph of
        it needs: the plan's tensors stay alive with the graph."""
        layout = SegmentLayout.of(grids, self.merge_size**2)
        rows = None if layout.rows is None else to_device(layout.rows, device)
        merged = None if layout.merged is None else to_device(layout.merged, device)
        return TowerPlan(layout.groups, rows, merged, self._rope_for(layout.frames, device))

    def run(self, pixel_values: torch.Tensor, plan: TowerPlan) -> torch.Tensor:
        """`forward` over items whose `plan` is made: [P, C·T·p·p] -> [P/merge², hidden], items in order."""
        x = self.patch_embed(pixel_values)  # [P, D]
        if plan.rows is not None:  # rows grouped by segment length from here to the merger
            x = x.index_select(0, plan.rows)
        begin_pass()  # the attention's backend gate counts this forward's shapes once
        pending = None
        for block in self.blocks:
            x, pending = block(x, pending, plan.rope, plan.groups)
        merged = self.merger(x, pending)  # [P/m², H]
        if plan.merged is None:
            return merged
        return merged.index_select(0, plan.merged)  # back to the items' order

    def _check_input(self, pixel_values: torch.Tensor, grids: list[Grid]) -> None:
        m = self.merge_size
        for t, h, w in grids:
            if t < 1 or h % m or w % m or h < m or w < m:
                raise ValueError(
                    f"grid (t={t}, h={h}, w={w}) must have t >= 1 and h, w positive multiples of spatial_merge_size {m}"
                )
        expected = sum(t * h * w for t, h, w in grids)
        if pixel_values.dim() != 2 or pixel_values.shape[0] != expected:
            raise ValueError(
                f"pixel_values {tuple(pixel_values.shape)} do not match the grids ({expected} patch rows expected)"
            )

    def _rope_for(self, frames: list[tuple[int, int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin of every patch row, for segments of (h, w) patches in this order (a video's frames each)."""
        parts = [self._grid_rope(h, w, device) for h, w in frames]
        if len(parts) == 1:
            return parts[0]
        return torch.cat([c for c, _ in parts]), torch.cat([s for _, s in parts])

    def _grid_rope(self, h: int, w: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        key = (h, w, device)
        if key in self._rope_cache:
            self._rope_cache.move_to_end(key)
            return self._rope_cache[key]
        tables = self._rope_cache[key] = _grid_cos_sin(h, w, self.merge_size, self.head_dim, device)
        if len(self._rope_cache) > ROPE_CACHE_SIZES:
            self._rope_cache.popitem(last=False)
        return tables


def _grid_cos_sin(h: int, w: int, merge: int, head_dim: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 cos/sin [h·w, 1, d_h/2] of the 2-D rotary for one frame, rows in merge-window order.

    A RoPE of dimension d_h/2 per axis: angles [row·f, col·f] (d_h/2 values); rotate-half pairs dim i
    with i + d_h/2 and both take angle i (the reference's table holds the angles twice, [a | a]).
    """
    rows, cols = _window_order_positions(h, w, merge, device)  # [h·w] each
    half = head_dim // 2
    inv_freq = 1.0 / (_ROPE_THETA ** (torch.arange(0, half, 2, dtype=torch.float32, device=device) / half))
    angles = torch.cat([rows[:, None] * inv_freq, cols[:, None] * inv_freq], dim=-1)[:, None, :]  # [h·w, 1, d_h/2]
    return angles.cos(), angles.sin()


def _window_order_positions(h: int, w: int, merge: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, col) of each patch, enumerated window by window like the processor's patch rows."""

    def reorder(grid: torch.Tensor) -> torch.Tensor:
        # [h, w] -> [h/m, m, w/m, m] -> [h/m, w/m, m, m] -> flat
        return grid.reshape(h // merge, merge, w // merge, merge).permute(0, 2, 1, 3).reshape(-1)

    rows = torch.arange(h, dtype=torch.float32, device=device)[:, None].expand(h, w)
    cols = torch.arange(w, dtype=torch.float32, device=device)[None, :].expand(h, w)
    return reorder(rows), reorder(cols)


@dataclass(frozen=True)
class TowerPlan:
    """A tower forward's inputs beside the pixels (`Qwen2VisionTransformer.plan`), all on the device.

    groups: `SegmentLayout.groups`. rows / merged: `SegmentLayout`'s orders as int64 tensors (None: items' order).
    rope: float32 (cos, sin) [P, 1, d_h/2] of every row in the tower's order.
    """

    groups: list[tuple[int, int, int]]
    rows: torch.Tensor | None
    merged: torch.Tensor | None
    rope: tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class SegmentLayout:
    """The order the tower runs its patch rows in: the attention segments (one per item and temporal patch)
    grouped by length, in order of each length's first segment, each group's segments in the items' order.

    frames: (h, w) of every segment, in that order.
    groups: (L, n, first row) per length: n segments of L rows from `first` on, contiguous.
    rows: int64 [P]: the items' row at each place of that order (None: it is the items' order already).
    merged: int64 [P/m²]: for each merged row in the items' order, its place in the tower's (None with rows).
    Equivalent to cu_seqlens = prefix sums of [h·w repeated t times] over the items.
    """

    frames: list[tuple[int, int]]
    groups: list[tuple[int, int, int]]
    rows: np.ndarray | None
    merged: np.ndarray | None

    @classmethod
    def of(cls, grids: list[Grid], merge_area: int) -> SegmentLayout:
        frames = [(h, w) for t, h, w in grids for _ in range(t)]
        lengths = np.array([h * w for h, w in frames], dtype=np.int64)
        starts = np.concatenate(([0], np.cumsum(lengths)))
        by_length: dict[int, list[int]] = {}
        for i, length in enumerate(lengths.tolist()):
            by_length.setdefault(length, []).append(i)
        order = [i for members in by_length.values() for i in members]
        groups, first = [], 0
        for length, members in by_length.items():
            groups.append((length, len(members), first))
            first += length * len(members)
        if order == sorted(order):
            return cls(frames, groups, None, None)
        rows = np.concatenate([np.arange(starts[i], starts[i + 1]) for i in order])
        place = np.empty(len(frames), dtype=np.int64)  # each segment's first row in the grouped order
        place[order] = np.cumsum(lengths[order]) - lengths[order]
        merged = np.concatenate([np.arange(p // merge_area, (p + n) // merge_area) for p, n in zip(place, lengths)])
        return cls([frames[i] for i in order], groups, rows, merged)
