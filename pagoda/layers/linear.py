"""Linear layers that own how checkpoint tensors land in their parameters, single-device or sharded
over the tensor-parallel group (`pagoda/distributed/parallel_state.py`).

`Linear` is replicated (every rank holds the whole weight): the vision tower, routers, LF convs.
The parallel layers read `tp_rank()` / `tp_world_size()` when constructed and hold only their rank's
share; at world size 1 each is exactly the single-device layer (same names, shapes and matmul):
- `ColumnParallelLinear`: output rows split, the output stays split (the next row-parallel layer
  consumes it as is);
- `MergedColumnParallelLinear`: several projections of one input fused ([out_0 | out_1 | ...]),
  each split separately, so rank r holds [out_0 share r | out_1 share r | ...];
- `QKVParallelLinear`: the merged q/k/v of (grouped-query) attention, split by heads; with fewer
  KV heads than ranks each rank holds a copy of the one KV head its query heads read;
- `RowParallelLinear`: input columns split; the partial outputs are summed over the ranks
  (all-reduce) and the bias is added once, after the sum.

Weight loading: a loader receives either a torch tensor or a lazy checkpoint tensor (a safetensors
slice: `LazyTensor`) and narrows it to the rank's share BEFORE reading it (`read_weight`), so a rank
reads only its share from disk. Loaders that do that carry `@reads_shards`; the model loader hands
every other loader an already-read tensor.

A layer called on a gathered subset of the step's tokens (an MoE expert: `gathered_rows`) can ask which step
token each input row is (`step_rows`): what a per-token addition to its output, such as a LoRA adapter's, reads.

`linear` is the one matmul entry point: on CUDA, inputs of few rows (decode at batch 1; up to 2-4 rows for
weights whose K fits one GEMV tile, by weight size: `gemv.max_rows_for`) go to the Triton GEMV
(`pagoda/kernels/gemv.py`: cuBLAS is latency-bound there), all others to `F.linear`.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import torch
import torch.nn.functional as F
from torch import nn

from pagoda.distributed import parallel_state
from pagoda.kernels import dispatch

_STEP_ROWS: ContextVar[torch.Tensor | None] = ContextVar("step_rows", default=None)


@contextlib.contextmanager
def gathered_rows(rows: torch.Tensor) -> Iterator[None]:
    """Within: linear layers run on the step's tokens `rows` (int64 [n], device), in that order."""
    token = _STEP_ROWS.set(rows)
    try:
        yield
    finally:
        _STEP_ROWS.reset(token)


def step_rows() -> torch.Tensor | None:
    """The step token of each input row of the layer running now (None: the step's tokens, all, in order)."""
    return _STEP_ROWS.get()


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias), through the few-row GEMV kernel where it applies."""
    kernels = dispatch.gemv_for(x)
    if kernels is not None and kernels.supports(x, weight) and (bias is None or bias.dtype == x.dtype):
        return kernels.gemv(x, weight, bias)
    return F.linear(x, weight, bias)


class LazyTensor(Protocol):
    """A checkpoint tensor not read yet: its shape, narrowed views, and `read()` of the view."""

    @property
    def shape(self) -> torch.Size: ...

    def dim(self) -> int: ...

    def narrow(self, dim: int, start: int, length: int) -> LazyTensor: ...

    def read(self) -> torch.Tensor: ...


Weight = torch.Tensor | LazyTensor


def read_weight(loaded: Weight, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The tensor behind `loaded` (read from disk now if lazy), in `dtype` when given."""
    tensor = loaded if isinstance(loaded, torch.Tensor) else loaded.read()
    return tensor if dtype is None else tensor.to(dtype)


_Loader = TypeVar("_Loader", bound=Callable[..., Any])


def reads_shards(loader: _Loader) -> _Loader:
    """Marks a weight loader that accepts a `LazyTensor` and reads only what its parameter holds."""
    loader.reads_shards = True  # type: ignore[attr-defined]
    return loader


def loader_reads_shards(loader: Callable[..., Any]) -> bool:
    return bool(getattr(loader, "reads_shards", False))


@reads_shards
def default_weight_loader(param: nn.Parameter, loaded: Weight, shard_id: object = None) -> None:
    """The whole checkpoint tensor into `param` (a replicated parameter). A one-element parameter takes
    any one-element tensor (a per-tensor scale is written as [], [1] or [1, 1] by different tools)."""
    scalar = param.numel() == 1 and math.prod(loaded.shape) == 1
    if param.shape != loaded.shape and not scalar:
        raise ValueError(f"shape mismatch: parameter {tuple(param.shape)} vs checkpoint {tuple(loaded.shape)}")
    param.data.copy_(read_weight(loaded, param.dtype).reshape(param.shape))


@dataclass(frozen=True)
class ParamLayout:
    """Where a parameter's output and input features lie, for sharding and fusing it.

    output / input: (dim, features per element along that dim), or None when the parameter does not
    run along that axis (then it is whole on every rank for that split). A plain weight [O, I] is
    ((0, 1), (1, 1)); a bias [O] ((0, 1), None). Quantized parameters differ: an int4 weight packed 8
    to an int32 along the output axis is (output (1, 8), input (0, 1)); group scales [I/G, O] are
    (output (1, 1), input (0, G)). per_part: one value per fused part (a per-tensor scale of each of
    q, k, v), indexed by the part, never split."""

    output: tuple[int, int] | None = (0, 1)
    input: tuple[int, int] | None = (1, 1)
    per_part: bool = False


_BIAS_LAYOUT = ParamLayout(input=None)


def param_layout(param: torch.Tensor) -> ParamLayout:
    layout = getattr(param, "shard_layout", None)
    if isinstance(layout, ParamLayout):
        return layout
    return ParamLayout() if param.dim() >= 2 else _BIAS_LAYOUT


def with_layout(param: nn.Parameter, layout: ParamLayout) -> nn.Parameter:
    param.shard_layout = layout  # type: ignore[attr-defined]  # (Tensor.layout is torch's own)
    return param


def _elements(features: int, per_element: int, what: str) -> int:
    if features % per_element:
        raise ValueError(f"{what} {features} is not a multiple of {per_element} (packed or grouped parameter)")
    return features // per_element


def _narrowed(loaded: Weight, dim: int, start: int, length: int) -> Weight:
    """loaded.narrow(...), skipped when it would keep everything (the world-size-1 case)."""
    if start == 0 and length == loaded.shape[dim]:
        return loaded
    return loaded.narrow(dim, start, length)


def _check_shape(param: torch.Tensor, loaded: Weight, dim: int, full: int, what: str = "") -> None:
    expected = tuple(full if d == dim else size for d, size in enumerate(param.shape))
    if tuple(loaded.shape) != expected:
        raise ValueError(f"shape mismatch{what}: parameter {expected} vs checkpoint {tuple(loaded.shape)}")


class QuantMethod(Protocol):
    """How a quantized linear layer holds and multiplies its weight (`pagoda/layers/quantization/`)."""

    def apply(self, layer: Linear, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor: ...

    def gemv_operands(self, layer: Linear) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """(weight, per-row weight scale) the few-row GEMV kernels can read, or None when they cannot."""
        ...


class Linear(nn.Module):
    """Replicated: the whole [output_size, input_size] weight on every rank.

    quant: set by `layers.quantization.quantize_linear_layers` on the parallel layers of a quantized
    model; it replaces `weight` with its own parameters and does the matmul."""

    quant: QuantMethod | None = None
    lora: Any = None  # lora.layers.LoRASlots: the adapters added to this layer's output (`pagoda/lora/`)

    def __init__(self, input_size: int, output_size: int, bias: bool = False):
        super().__init__()
        self.input_size, self.output_size = input_size, output_size  # this rank's
        self.weight = nn.Parameter(torch.empty(output_size, input_size))
        self.bias = nn.Parameter(torch.empty(output_size)) if bias else None

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.quant is not None:
            return self.quant.apply(self, x, bias)
        return linear(x, self.weight, bias)

    def gemv_operands(self) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """What a fused GEMV (`kernels/gemv.py`) multiplies by in place of this layer's matmul:
        (weight, None) unquantized, (fp8 weight, its row scales) for fp8, None when it cannot (int4, adapters)."""
        if self.lora is not None:
            return None
        if self.quant is not None:
            return self.quant.gemv_operands(self)
        return self.weight, None

    def lora_row_maps(self) -> dict[str, tuple[torch.Tensor, torch.Tensor, int]] | None:
        """For a layer whose checkpoint projections interleave in its output rows (not side by side):
        {projection: (its rows, the local output rows they land on, its full rows)}; None for the others."""
        return None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.lora is None:
            return self.matmul(x, self.bias)
        return self.lora.apply(x, lambda: self.matmul(x, self.bias))


class ColumnParallelLinear(Linear):
    """y_r = x · W_rᵀ + b_r with W_r = rows [r·O/N, (r+1)·O/N) of the [O, I] weight: [T, I] → [T, O/N]."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False):
        self.full_output_size = output_size
        self.output_start, local = parallel_state.shard(output_size, "output size")
        super().__init__(input_size, local, bias)

    @reads_shards
    def weight_loader(self, param: nn.Parameter, loaded: Weight, shard_id: object = None) -> None:
        layout = param_layout(param)
        if layout.output is None:
            default_weight_loader(param, loaded)
            return
        dim, per = layout.output
        _check_shape(param, loaded, dim, _elements(self.full_output_size, per, "output size"))
        start = _elements(self.output_start, per, "rank's first output row")
        param.data.copy_(read_weight(_narrowed(loaded, dim, start, param.shape[dim]), param.dtype))


class MergedColumnParallelLinear(Linear):
    """Projections of one input fused into one matmul, each split over the ranks on its own.

    Rank r holds [part_0 rows r | part_1 rows r | ...] (its output is laid out the same way, so a
    `[gate | up]` chunk or a q/k/v split of it works as on one device). A checkpoint tensor is one
    part (shard_id = its name, through the model's `packed_modules_mapping`) or, with shard_id None,
    all parts concatenated along the rows (Yuan M32's expert `w1` = [activated | linear]).
    """

    def __init__(
        self,
        input_size: int,
        output_sizes: Sequence[int],
        bias: bool = False,
        shard_names: tuple[str, ...] | None = None,
        part_ranges: Sequence[tuple[int, int]] | None = None,
    ):
        """part_ranges: (start, length) of this rank's rows in each part's checkpoint tensor; by
        default an even contiguous split of each part."""
        self.full_output_sizes = list(output_sizes)
        if part_ranges is None:
            part_ranges = [parallel_state.shard(size, "output size") for size in output_sizes]
        self.part_ranges = list(part_ranges)
        self.output_sizes = [length for _, length in self.part_ranges]  # local: the forward's split sizes
        self.shard_names = shard_names or tuple(str(i) for i in range(len(output_sizes)))
        super().__init__(input_size, sum(self.output_sizes), bias)

    def _load_part(self, param: nn.Parameter, loaded: Weight, index: int) -> None:
        layout = param_layout(param)
        if layout.per_part:  # one value per part (a per-tensor scale)
            param.data[index] = read_weight(loaded, param.dtype).reshape(())
            return
        if layout.output is None:  # not along the output (an act-order g_idx): the same in every part
            default_weight_loader(param, loaded)
            return
        dim, per = layout.output
        start, length = self.part_ranges[index]
        offset = _elements(sum(self.output_sizes[:index]), per, "fused part offset")
        length = _elements(length, per, "rank's part rows")
        target = param.data.narrow(dim, offset, length)
        target.copy_(read_weight(_narrowed(loaded, dim, _elements(start, per, "part start"), length), param.dtype))

    @reads_shards
    def weight_loader(self, param: nn.Parameter, loaded: Weight, shard_id: object = None) -> None:
        layout = param_layout(param)
        dim, per = layout.output or (0, 1)
        if shard_id is None:  # every part, concatenated along the rows
            if layout.per_part or layout.output is None:
                raise ValueError("a per-part or output-less parameter needs one checkpoint tensor per part")
            _check_shape(param, loaded, dim, _elements(sum(self.full_output_sizes), per, "output size"))
            offset = 0
            for index, size in enumerate(self.full_output_sizes):
                rows = _elements(size, per, "part size")
                self._load_part(param, _narrowed(loaded, dim, offset, rows), index)
                offset += rows
            return
        index = self.shard_names.index(str(shard_id))
        if not layout.per_part and layout.output is not None:
            full = _elements(self.full_output_sizes[index], per, "part size")
            _check_shape(param, loaded, dim, full, f" for shard {shard_id}")
        self._load_part(param, loaded, index)


def kv_head_range(num_kv_heads: int) -> tuple[int, int]:
    """(first KV head, count) this rank holds: an even split when the KV heads divide by the world
    size; with fewer KV heads than ranks, the one KV head of this rank's query heads (rank r of N
    reads KV head r // (N / kv_heads)), replicated over N / kv_heads ranks."""
    world, rank = parallel_state.tp_world_size(), parallel_state.tp_rank()
    if num_kv_heads >= world:
        return parallel_state.shard(num_kv_heads, "num_key_value_heads")
    if world % num_kv_heads:
        raise ValueError(f"tensor_parallel_size {world} must be a multiple of num_key_value_heads {num_kv_heads}")
    return rank // (world // num_kv_heads), 1


class QKVParallelLinear(MergedColumnParallelLinear):
    """[q | k | v] of attention split by heads: rank r holds query heads [r·Hq/N, (r+1)·Hq/N) and
    the KV heads of `kv_head_range` (a replicated copy where Hkv < N)."""

    def __init__(self, input_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False):
        q_start, q_heads = parallel_state.shard(num_heads, "num_attention_heads")
        kv_start, kv_heads = kv_head_range(num_kv_heads)
        self.num_heads, self.num_kv_heads, self.head_dim = q_heads, kv_heads, head_dim  # local counts
        kv_range = (kv_start * head_dim, kv_heads * head_dim)
        super().__init__(
            input_size,
            [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim],
            bias,
            ("q", "k", "v"),
            [(q_start * head_dim, q_heads * head_dim), kv_range, kv_range],
        )


class RowParallelLinear(Linear):
    """y = Σ_r x_r · W_rᵀ + b with W_r = columns [r·I/N, (r+1)·I/N) of the [O, I] weight and x_r this
    rank's share of the input: [T, I/N] → [T, O], the same full output on every rank.

    reduce_results=False leaves the partial sum (the caller reduces once, e.g. after an expert sum;
    then there must be no bias)."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False, reduce_results: bool = True):
        self.tp_size = parallel_state.tp_world_size()
        self.full_input_size = input_size
        self.input_start, local = parallel_state.shard(input_size, "input size")
        if bias and not reduce_results and self.tp_size > 1:
            raise ValueError("a row-parallel layer that leaves the reduction to its caller cannot add a bias")
        self.reduce_results = reduce_results
        super().__init__(local, output_size, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return super().forward(x)
        if self.lora is None:
            out = self.matmul(x, None)
        else:  # this rank's share of the adapters' terms: the all-reduce sums them too
            out = self.lora.apply(x, lambda: self.matmul(x, None))
        if not self.reduce_results:
            return out
        parallel_state.all_reduce(out)
        return out if self.bias is None else out + self.bias

    @reads_shards
    def weight_loader(self, param: nn.Parameter, loaded: Weight, shard_id: object = None) -> None:
        layout = param_layout(param)
        if layout.input is None:  # the bias (added after the reduction), per-channel scales: whole on every rank
            default_weight_loader(param, loaded)
            return
        dim, per = layout.input
        _check_shape(param, loaded, dim, _elements(self.full_input_size, per, "input size"))
        start = _elements(self.input_start, per, "rank's first input column")
        param.data.copy_(read_weight(_narrowed(loaded, dim, start, param.shape[dim]), param.dtype))
