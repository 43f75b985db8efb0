"""Adapters on a linear layer: y = x·Wᵀ (+ b) + Σ over the row's adapter of s·(x·Aᵀ)·Bᵀ.

Each adapted layer holds its adapters in `max_loras` slots, per output part (q/k/v of a fused qkv projection,
gate/up of a fused MLP projection each have their own A and B):

    A [parts, max_loras, max_rank, in]    B [max_loras, out, max_rank]   (B's parts side by side, scaled by s)

An adapter of rank r < max_rank fills the first r rows of A and columns of B; the rest stay zero, which adds
exactly nothing. A step's tokens each belong to a slot, or to none (the base model). `LoRAStep` holds that
mapping twice: per slot in use the token indices (the PyTorch reference path: a gather, two small matmuls and
an index-add per slot and part), and as one int32 device buffer the Triton kernels read (`kernels/lora.py`:
tiles of at most TILE_TOKENS tokens of one slot, then the tokens grouped by slot). The buffer is allocated
once and written in place each step, so CUDA graphs captured over the kernels replay with any step's mapping.

On CUDA with Triton the kernels run (`PAGODA_LORA_KERNELS=0`: the reference); elsewhere the reference. A decoder
layer may hold its A inside its own weight instead (`LoRASlots.stack_under`): W_ext = [W; A viewed as P·L·R rows],
the layer's `weight` a view of its first rows. Launches of at most `policy.LORA_STACKED_MAX_TOKENS` tokens multiply
by W_ext, whose extra output columns are every slot's x·Aᵀ, and launch the expand alone; the layer's output is then
a view with a row stride past its width, as a q/k/v split of a fused projection is.
Layers of a multimodal encoder (Qwen2-VL's vision tower) share an `EncoderLoRAStep` instead: PyTorch matmuls per
slot (`LoRASlots.add_grouped`), its mapping written for each encoder call (thousands of patch rows, never replayed
from a CUDA graph).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from pagoda import envs
from pagoda.device_copy import to_device
from pagoda.kernels import dispatch, policy
from pagoda.layers.linear import linear, step_rows

# Tokens per kernel tile (`kernels/lora.py`): a slot's tokens are cut into tiles of at most this many. Steps of
# at most SMALL_STEP_TOKENS tokens (decode, a few adapters' rows each) use the small tile: a 64-token tile then
# held a handful of real rows and the kernels spent their registers and loads on masked ones
# (`benchmarks/kernels/lora_kernel_bench.py` times both). A step of at most SMALL_STEP_TOKENS may still replay a
# larger graph bucket, which launches over the bucket's rows with the large tile: both tilings are written for it.
TILE_TOKENS = 64
SMALL_TILE_TOKENS = 16
SMALL_STEP_TOKENS = 256
# Launches over at most this many tokens run the shrink on a side stream (`LoRASlots.apply`): beside a decode
# step's weight-bound matmul it fills idle SMs; at 256 tokens the matmul fills them and the overlap lost.
SIDE_STREAM_MAX_TOKENS = 128


@dataclass
class LoRAStep:
    """The step's adapters, shared by every adapted layer.

    meta: int32 on the device, written by `write` (the kernels' mapping): for each tiling (small, then large),
    (slot, first place, tokens) per tile for up to its `max_tiles` tiles; then from `order_at` the adapted
    tokens grouped by slot. `tiling(T)` says which a launch over T tokens reads.
    active: (slot, its tokens: a view of meta) for every slot in use (the reference path)."""

    max_loras: int = 1
    max_tokens: int = 0
    device: torch.device = torch.device("cpu")
    tile_sizes: tuple[int, ...] = (SMALL_TILE_TOKENS, TILE_TOKENS)  # (small steps, the rest)
    small_step_tokens: int = SMALL_STEP_TOKENS
    side_stream: bool = field(default_factory=lambda: envs.LORA_SIDE_STREAM.value)  # see LoRASlots.apply
    active: list[tuple[int, torch.Tensor]] = field(default_factory=list)
    meta: torch.Tensor = field(init=False)
    _token_slots: np.ndarray = field(init=False, default_factory=lambda: np.zeros(0, dtype=np.int64))
    _token_slots_device: torch.Tensor | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        # A graph bucket may pad a step past max_tokens (or past small_step_tokens); its grid has
        # cdiv(bucket, tile) + max_loras tiles.
        small, large = self.tile_sizes
        self.max_tiles = (
            -(-2 * self.small_step_tokens // small) + self.max_loras,
            -(-2 * self.max_tokens // large) + self.max_loras,
        )
        self.tiles_at = (0, 3 * self.max_tiles[0])
        self.order_at = 3 * sum(self.max_tiles)
        self.meta = torch.zeros(self.order_at + self.max_tokens, dtype=torch.int32, device=self.device)

    def tiling(self, num_tokens: int) -> tuple[torch.Tensor, int, int]:
        """(meta from the tiling's first tile, where the order starts in it, tokens per tile) for a launch over
        num_tokens tokens (a graph bucket's count, at least the step's)."""
        which = 0 if num_tokens <= self.small_step_tokens else 1
        at = self.tiles_at[which]
        return self.meta[at:], self.order_at - at, self.tile_sizes[which]

    def write(self, token_slots: np.ndarray) -> None:
        """The step's mapping from token_slots [T] (each token's slot, -1: the base model)."""
        if len(token_slots) > self.max_tokens:
            raise RuntimeError(f"a step of {len(token_slots)} tokens, more than the {self.max_tokens} LoRA sized for")
        order, counts, starts = _by_slot(token_slots, self.max_loras)
        # Tiles past the step's hold 0 tokens; the small tiling only for steps that may launch with it.
        tilings = [np.zeros((n, 3), dtype=np.int64) for n in self.max_tiles]
        fill = slice(0 if len(token_slots) <= self.small_step_tokens else 1, None)  # tilings[0]: the small tiles
        for tiles, tile in zip(tilings[fill], self.tile_sizes[fill]):
            i = 0
            for slot in np.flatnonzero(counts).tolist():
                for first in range(0, int(counts[slot]), tile):
                    tiles[i] = slot, starts[slot] + first, min(tile, counts[slot] - first)
                    i += 1
        host = np.concatenate((*(t.reshape(-1) for t in tilings), order)).astype(np.int32)
        if self.device.type == "cuda":
            self.meta[: len(host)].copy_(torch.from_numpy(host).pin_memory(), non_blocking=True)
        else:
            self.meta[: len(host)].copy_(torch.from_numpy(host))
        self._token_slots, self._token_slots_device = token_slots, None
        self.active = _slot_groups(self.meta[self.order_at :], counts, starts)

    def gathered(self, rows: torch.Tensor) -> list[tuple[int, torch.Tensor]]:
        """`active` for a layer that runs on the step's tokens `rows` (`layers.linear.gathered_rows`: an MoE
        expert's): per slot in use, the places in `rows` of its tokens. One host-device sync (the counts), as
        the expert loop has for each expert anyway."""
        if self._token_slots_device is None:  # copied on the first gathered call of the step only
            self._token_slots_device = to_device(self._token_slots, self.device)
        row_slots = self._token_slots_device.index_select(0, rows) + 1  # 0: the base model's rows
        order = torch.argsort(row_slots, stable=True)
        counts = torch.bincount(row_slots, minlength=self.max_loras + 1).tolist()
        starts = np.cumsum([0, *counts]).tolist()
        return [(s - 1, order[starts[s] : starts[s] + counts[s]]) for s in range(1, len(counts)) if counts[s]]


class EncoderLoRAStep:
    """The mapping of an encoder's adapted layers for one encoder call: `active` as `LoRAStep`'s, for `rows` rows.

    An encoder call runs thousands of rows through a few adapters, where per-slot gathers and cuBLAS matmuls are
    what the kernels would do. The mapping belongs to the thread that wrote it (the engine's): the encoder's
    graph captures, and their warm-up forwards, run on a thread of their own meanwhile and see none, so a graph
    holds the base model only, and the encoder runner runs every call with adapters eagerly."""

    def __init__(self, device: torch.device):
        self.device = device
        self._local = threading.local()

    @property
    def rows(self) -> int:
        return getattr(self._local, "rows", 0)

    @property
    def active(self) -> list[tuple[int, torch.Tensor]]:
        return getattr(self._local, "active", [])

    def write(self, row_slots: np.ndarray) -> None:
        """This thread's mapping from row_slots [R] (each row's slot, -1: the base model's)."""
        self._local.rows, self._local.active = len(row_slots), []
        order, counts, starts = _by_slot(row_slots, 1)
        if not len(order):
            return
        self._local.active = _slot_groups(to_device(order, self.device), counts, starts)

    def clear(self) -> None:
        self._local.rows, self._local.active = 0, []


def _by_slot(row_slots: np.ndarray, min_slots: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(the adapted rows grouped by slot, each group in row order; rows per slot, at least min_slots of them;
    each slot's first place in that order) of row_slots [R] (-1: the base model's row)."""
    adapted = np.flatnonzero(row_slots >= 0)
    order = adapted[np.argsort(row_slots[adapted], kind="stable")]
    counts = np.bincount(row_slots[adapted], minlength=min_slots)
    return order, counts, np.concatenate(([0], np.cumsum(counts)[:-1]))


def _slot_groups(in_order: torch.Tensor, counts: np.ndarray, starts: np.ndarray) -> list[tuple[int, torch.Tensor]]:
    """(slot, its rows: a view of in_order, the rows grouped by slot as `_by_slot` orders them) per slot in use."""
    return [(slot, in_order[s : s + n]) for slot, (s, n) in enumerate(zip(starts.tolist(), counts.tolist())) if n]


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
        step: LoRAStep | EncoderLoRAStep,
    ):
        """input_range: (this rank's first input feature, its count, all input features): a row-parallel layer
        takes a share of the input, so its A is cut by columns the same way (its partial outputs, adapters
        included, are summed over the ranks by the layer's all-reduce: (Σ x_r·A_rᵀ)·Bᵀ = (x·Aᵀ)·Bᵀ)."""
        ends = np.cumsum([p.size for p in parts]).tolist()
        if [p.offset for p in parts] != [0, *ends[:-1]]:
            raise ValueError("a layer's adapted parts must tile its output in order")
        self.parts, self.step, self.input_range = parts, step, input_range
        self.row_maps: dict[str, tuple[torch.Tensor, torch.Tensor, int]] | None = None  # see Linear.lora_row_maps
        self.a = torch.zeros(len(parts), max_loras, max_rank, input_range[1], dtype=dtype, device=device)
        self.b = torch.zeros(max_loras, ends[-1], max_rank, dtype=dtype, device=device)
        self.bounds = torch.tensor([0, *ends], dtype=torch.int32, device=device)
        self.stacked: tuple[torch.Tensor, torch.Tensor | None] | None = None  # (W_ext, its bias): `stack_under`
        self._expand_operands: dict[int, torch.Tensor] = {}  # slot -> `_expand_operand`'s block, until `set` refills it

    def part_index(self, name: str | None) -> int:
        return next(i for i, p in enumerate(self.parts) if p.name == name)

    def set(self, slot: int, weights: dict[str | None, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Slot `slot` ← an adapter's {part: (A [r, in], B [out_part, r], scaled)}; parts it leaves out add zero."""
        self.a[:, slot].zero_()
        self.b[slot].zero_()
        self._expand_operands.pop(slot, None)
        for name, (a, b) in weights.items():
            i = self.part_index(name)
            rank, part = a.shape[0], self.parts[i]
            self.a[i, slot, :rank].copy_(a)
            self.b[slot, part.offset : part.offset + part.size, :rank].copy_(b)

    def stack_under(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        """Moves the layer's weight [out, in] (and bias) into W_ext [out + P·L·R, in] whose rows past `out` are A
        (the slots' A become a view of them, so `set` writes there), and the parameters into views of its first
        rows: the layer's own matmul is unchanged, and `apply` may multiply by W_ext instead. The caller checks
        that the layer's matmul is `linear(x, weight, bias)` on this device, in A's dtype."""
        out, k = weight.shape
        extra = self.a.numel() // k
        stacked = _grown(weight, extra)
        stacked[out:].copy_(self.a.reshape(extra, k))
        self.a = stacked[out:].view(self.a.shape)
        self.stacked = stacked, None if bias is None else _grown(bias, extra)

    def apply(self, x: torch.Tensor, matmul: Callable[[], torch.Tensor]) -> torch.Tensor:
        """matmul() (the layer's own product of x [T, in], [T, out]) plus each token's adapter applied to x.

        With the kernels: a layer whose A are stacked under its weight (`stack_under`) multiplies launches of at
        most `policy.LORA_STACKED_MAX_TOKENS` tokens by W_ext and launches the expand alone. Otherwise, on CUDA,
        for launches over at most SIDE_STREAM_MAX_TOKENS tokens and unless PAGODA_LORA_SIDE_STREAM=0, the shrink
        runs on a side stream while the layer's matmul runs: a decode-sized step's matmul is bound by reading the
        weights, and the shrink's few small programs then fill SMs it leaves idle instead of adding their launch
        and tail to the step. Its partial sums are allocated here, on the caller's stream, which joins the side
        stream before the expand reads them, so neither they nor x are freed while the side stream may still use
        them."""
        if isinstance(self.step, EncoderLoRAStep):
            return self._apply_encoder(x, matmul)
        rows = step_rows()
        if rows is not None:  # an MoE expert's share of the step's tokens: the reference path over them
            y = matmul()
            return self.add_reference(x, y, self.step.gathered(rows)) if self.step.active else y
        kernels = dispatch.lora_for(x)
        # Captured graphs launch the kernels whatever the step: replays read the mapping from `meta`.
        if kernels is None or not (self.step.active or (x.is_cuda and torch.cuda.is_current_stream_capturing())):
            return self.add_reference(x, matmul())
        meta, order_at, tile = self.step.tiling(x.shape[0])
        if self.stacked is not None and x.shape[0] <= policy.LORA_STACKED_MAX_TOKENS:
            y_ext = linear(x, *self.stacked)
            return kernels.expand_stacked(y_ext, self.b, self.bounds, meta, order_at, tile)
        if not (x.is_cuda and self.step.side_stream and x.shape[0] <= SIDE_STREAM_MAX_TOKENS):
            return kernels.add_lora(x, matmul(), self.a, self.b, self.bounds, meta, order_at, tile)
        h = kernels.shrink_buffer(x, self.a, tile, beside_matmul=True)
        main, side = torch.cuda.current_stream(x.device), _side_stream(x.device)
        side.wait_stream(main)
        with torch.cuda.stream(side):
            kernels.shrink(x, self.a, meta, order_at, tile, h=h)
        y = matmul()
        main.wait_stream(side)
        kernels.check_expand(y, self.a, self.b, self.bounds, x.shape[0])
        return kernels.expand(h, y, self.b, self.bounds, meta, order_at, tile)

    def _apply_encoder(self, x: torch.Tensor, matmul: Callable[[], torch.Tensor]) -> torch.Tensor:
        step = self.step
        assert isinstance(step, EncoderLoRAStep)
        if not step.active:
            return matmul()
        if x.shape[0] != step.rows:
            raise RuntimeError(f"an encoder layer ran over {x.shape[0]} rows; its adapters were mapped for {step.rows}")
        return self.add_grouped(x, matmul(), step.active)

    def add_grouped(self, x: torch.Tensor, y: torch.Tensor, active: list[tuple[int, torch.Tensor]]) -> torch.Tensor:
        """`add_reference` for calls of many rows per slot (the encoder's): per slot one shrink over every part at
        once (A's P·R rows as one operand) and one expand over the whole output (`_expand_operand`), added into y
        by one matmul where the slot holds every row (in order, as `_by_slot` groups them) and by one index-add
        otherwise. The reference reads the gathered rows once per part and writes and re-reads a temporary per
        part. Sums may differ from the reference's by an ulp in 16-bit dtypes (the expand is added in the
        matmul's accumulator, not rounded first)."""
        for slot, rows in active:
            shrink = self.a[:, slot].reshape(-1, self.a.shape[-1])  # [P·R, in]
            expand = self._expand_operand(slot)  # [out, P·R]
            if rows.numel() == x.shape[0]:
                y.addmm_((x.to(shrink.dtype) @ shrink.t()).to(y.dtype), expand.t().to(y.dtype))
            else:
                delta = (x.index_select(0, rows).to(shrink.dtype) @ shrink.t()) @ expand.t()
                y.index_add_(0, rows, delta.to(y.dtype))
        return y

    def _expand_operand(self, slot: int) -> torch.Tensor:
        """Slot `slot`'s B as one [out, P·R] operand for a shrink of every part at once: each part's output rows
        take its own rank columns, zeros elsewhere (so parts do not mix). Built once per adapter in the slot: every
        encoder call of every layer reads it, and building it is a zero fill and a copy per part."""
        if len(self.parts) == 1:
            return self.b[slot]
        block = self._expand_operands.get(slot)
        if block is None:
            rank = self.b.shape[2]
            block = self.b.new_zeros(self.b.shape[1], len(self.parts) * rank)
            for i, part in enumerate(self.parts):
                rows = slice(part.offset, part.offset + part.size)
                block[rows, i * rank : (i + 1) * rank] = self.b[slot, rows]
            self._expand_operands[slot] = block
        return block

    def add_reference(
        self, x: torch.Tensor, y: torch.Tensor, active: list[tuple[int, torch.Tensor]] | None = None
    ) -> torch.Tensor:
        """y [T, out] plus each row's adapter applied to x [T, in], per slot and part in PyTorch; `active`: (slot,
        its rows) for each slot in use (default: the step's)."""
        for slot, tokens in self.step.active if active is None else active:
            xs = x.index_select(0, tokens).to(self.a.dtype)
            for i, part in enumerate(self.parts):
                b = self.b[slot, part.offset : part.offset + part.size]
                delta = (xs @ self.a[i, slot].t()) @ b.t()  # [n, out_part]
                y[:, part.offset : part.offset + part.size].index_add_(0, tokens, delta.to(y.dtype))
        return y


def _grown(param: torch.Tensor, rows: int) -> torch.Tensor:
    """A zeroed tensor of `rows` more rows than `param`, its first rows holding param's values; param's data becomes a
    view of them (so the module reads the same values, from the grown tensor's memory)."""
    grown = param.new_zeros(param.shape[0] + rows, *param.shape[1:])
    grown[: param.shape[0]].copy_(param.data)
    param.data = grown[: param.shape[0]]
    return grown


@functools.cache
def _side_stream(device: torch.device) -> torch.cuda.Stream:
    """The stream adapters' shrinks run on beside the layers' matmuls, one per device."""
    return torch.cuda.Stream(device)
