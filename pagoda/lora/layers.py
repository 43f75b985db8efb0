"""Adapters on a linear layer: y = x·Wᵀ (+ b) + Σ over the row's adapter of s·(x·Aᵀ)·Bᵀ.

Each adapted layer holds its adapters in `max_loras` slots, per output part (q/k/v of a fused qkv projection,
gate/up of a fused MLP projection each have their own A and B):

    A [max_loras, max_rank, in]    B [max_loras, out_part, max_rank]    (B already scaled by s)

An adapter of rank r < max_rank fills the first r rows of A and columns of B; the rest stay zero, which adds
exactly nothing. A step's rows each name a slot (or none: the base model); `LoRAStep` holds, for every slot in
use, the flat indices of its tokens, and `LoRASlots.add` multiplies each slot's tokens by its A and B (a gather,
two small matmuls and an index-add per slot in use: the reference path).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class LoRAStep:
    """The step's adapters: (slot, flat token indices [n] on the device) for every slot in use."""

    active: list[tuple[int, torch.Tensor]] = field(default_factory=list)


@dataclass(frozen=True)
class LoRAPart:
    name: str | None  # the checkpoint's projection this part is (None: the layer is not fused)
    offset: int  # its first output feature in the layer's output (this rank's)
    size: int  # its output features on this rank
    start: int = 0  # under tensor parallelism: this rank's first row of the whole part (B is cut the same way)
    full: int = 0  # the whole part's rows (0: size)


class LoRASlots:
    """One linear layer's adapter slots (see the module docstring); `step` is shared by every layer."""

    def __init__(
        self,
        input_range: tuple[int, int, int],
        parts: list[LoRAPart],
        max_loras: int,
        max_rank: int,
        dtype: torch.dtype,
        device: torch.device,
        step: LoRAStep,
    ):
        """input_range: (this rank's first input feature, its count, all input features): a row-parallel layer
        takes a share of the input, so its A is cut by columns the same way (its partial outputs, adapters
        included, are summed over the ranks by the layer's all-reduce: (Σ x_r·A_rᵀ)·Bᵀ = (x·Aᵀ)·Bᵀ)."""
        self.parts, self.step, self.input_range = parts, step, input_range
        input_size = input_range[1]
        self.a = [torch.zeros(max_loras, max_rank, input_size, dtype=dtype, device=device) for _ in parts]
        self.b = [torch.zeros(max_loras, p.size, max_rank, dtype=dtype, device=device) for p in parts]

    def part_index(self, name: str | None) -> int:
        return next(i for i, p in enumerate(self.parts) if p.name == name)

    def set(self, slot: int, weights: dict[str | None, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Slot `slot` ← an adapter's {part: (A [r, in], B [out_part, r], scaled)}; parts it leaves out add zero."""
        for a, b in zip(self.a, self.b):
            a[slot].zero_()
            b[slot].zero_()
        for name, (a, b) in weights.items():
            i = self.part_index(name)
            rank = a.shape[0]
            self.a[i][slot, :rank].copy_(a)
            self.b[i][slot, :, :rank].copy_(b)

    def add(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y [T, out] plus each row's adapter applied to x [T, in] (y itself when no row has one)."""
        if not self.step.active:
            return y
        for slot, tokens in self.step.active:
            xs = x.index_select(0, tokens)
            for part, a, b in zip(self.parts, self.a, self.b):
                delta = (xs @ a[slot].t()) @ b[slot].t()  # [n, out_part]
                y[:, part.offset : part.offset + part.size].index_add_(0, tokens, delta.to(y.dtype))
        return y
