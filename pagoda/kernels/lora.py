"""Many adapters on one linear layer in two Triton launches: shrink h = x·Aᵀ, then expand y += h·Bᵀ, each
token by the adapter in its slot (the segmented "shrink/expand" pair of multi-LoRA serving).

Operands (the layout of `pagoda/lora/layers.py`, whose `LoRASlots.add_reference` is the PyTorch reference):

    x [T, in]                 the layer's input          y [T, out]   its output, added to in place
    A [P, L, R, in]           per output part p and slot l (rank r < R: rows past r are zero)
    B [L, out, R]             the parts side by side along out, already scaled by alpha/r
    bounds [P + 1] int32      part p owns y's columns [bounds[p], bounds[p + 1])
    meta int32                first (slot, first place in order, tokens) per tile of at most `tile_tokens`
                              tokens of one slot, tiles of 0 tokens past the step's; from order_at on,
                              order: the step's adapted tokens grouped by slot

The grids depend on T, L and the shapes only, never on device values: a CUDA graph captured for a bucket
replays with any mapping the step writes into `meta`. A step of T tokens has at most cdiv(T, tile_tokens) + L
tiles (each slot's last tile may be partial); programs past the last tile return at once.

Shrink, grid (tiles, SPLIT_K): program (i, s) multiplies tile i's tokens by every part's A at once (the P·R
rows of the slot's A read as one [P·R, in] operand, so x is read once) over its share s of `in`, and writes
the partial sums h[s, place, p·R + r] (fp32; a token's place in `order`, so h is dense). Few tokens (decode)
leave few programs, so the input dimension is split over SPLIT_K programs; expand adds the partials in a
fixed order (deterministic, no atomics).

Expand, grid (tiles · cdiv(out, BLOCK_N)): the partials summed and rounded to B's dtype (the reference rounds
x·Aᵀ to the adapter dtype too), times a [P·R, BLOCK_N] operand that holds B's rank columns in the rows of
each column's own part and zeros elsewhere (so one product serves columns of several parts), added to y in
fp32 and rounded once to y's dtype (the reference rounds the term first, then the sum: bf16 results may
differ by an ulp). Every (token, column) of y is written by one program: a token is in one tile.

Stacked (`expand_stacked`): a layer whose slots' A sit under its weight as extra rows (`lora/layers.py`) gets the
shrink from its own matmul, as the columns past `out` of y_ext = x·[W; A]ᵀ: part p, slot l, rank row r is column
out + (p·L + l)·R + r, rounded to the model's dtype by the matmul. The expand alone then reads each token's own
slot's columns from the token's row of y_ext (H_BY_TOKEN, one split) and adds into its first `out` columns.

Both launch with PDL (`kernels/pdl.py`) in launches of at most `policy.LORA_PDL_MAX_ROWS` tokens: a tile's
bookkeeping (and the expand's B tile, read-only in a step) is loaded before waiting for the previous kernel.

`add_lora` launches both; `shrink` and `expand` launch one each, for a caller that runs them on different
streams (`lora/layers.py`); `expand_stacked` the stacked expand. Launchers check shapes and dtypes and launch;
they never read device values on the host.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagoda.kernels import pdl, policy
from pagoda.kernels.pdl import wait_for_inputs
from pagoda.kernels.triton_utils import DTYPES, dot_flags, interpreting, mma, round_to

BLOCK_N = 256  # expand: output columns per program
BLOCK_K = 64  # shrink: input features per loop iteration (128 for tiles of at most 16 tokens)


def split_k(num_tiles: int, input_size: int, beside_matmul: bool = False) -> int:
    """Shrink programs per tile: a step of few tiles (decode: a handful of tokens per adapter) spreads each
    tile's input dimension over programs; a step of 128 tiles or more already fills the SMs.

    Alone on the stream, to ~1024 programs in all, each looping over at least 256 input features (at most 32
    splits): the shrink is then a launch whose time is its longest program's. Beside the layer's matmul (the
    side stream, `lora/layers.py`), to ~256 programs of at least 512 features (at most 16): there more programs
    take SMs from the matmul (`benchmarks/lora_gpu.py` measured both rules at both places, docs/performance.md)."""
    if num_tiles >= 128:
        return 1
    if beside_matmul:
        return max(1, min(16, input_size // 512, -(-256 // num_tiles)))
    return max(1, min(32, input_size // 256, -(-1024 // num_tiles)))


@triton.jit
def _tile(meta_ptr, ORDER_AT, BLOCK_M: tl.constexpr):
    """Tile program_id(0)'s (slot, its tokens' places in `order`, their token indices, row mask, tokens)."""
    entry = meta_ptr + 3 * tl.program_id(0)
    first = tl.load(entry + 1)
    count = tl.load(entry + 2)
    rows = tl.arange(0, BLOCK_M)
    valid = rows < count
    place = first + rows
    token = tl.load(meta_ptr + ORDER_AT + place, mask=valid, other=0).to(tl.int64)
    return tl.load(entry), place, token, valid, count


@triton.jit(do_not_specialize=["K_PER_SPLIT"])
def _shrink_kernel(
    x_ptr,
    a_ptr,
    h_ptr,
    meta_ptr,
    stride_x,
    stride_a,  # A's 4 strides
    stride_h,  # h's 3 strides
    ORDER_AT,
    K,
    K_PER_SPLIT,
    R,
    NUM_PARTS,
    BLOCK_M: tl.constexpr,
    BLOCK_PR: tl.constexpr,
    BLOCK_K: tl.constexpr,
    IEEE: tl.constexpr,
    UPCAST: tl.constexpr,
    PDL: tl.constexpr,
):
    slot, place, token, valid, count = _tile(meta_ptr, ORDER_AT, BLOCK_M)  # meta: written before the step's kernels
    wait_for_inputs(PDL)  # x is the previous kernels' output
    if count > 0:
        j = tl.arange(0, BLOCK_PR)  # part j // R, rank row j % R
        in_j = j < NUM_PARTS * R
        a_rows = a_ptr + (j // R) * stride_a[0] + slot * stride_a[1] + (j % R) * stride_a[2]
        acc = tl.zeros((BLOCK_M, BLOCK_PR), dtype=tl.float32)
        k_start = tl.program_id(1) * K_PER_SPLIT
        k_end = tl.minimum(k_start + K_PER_SPLIT, K)
        for k0 in range(k_start, k_end, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            in_k = k < k_end
            xt = tl.load(x_ptr + token[:, None] * stride_x + k[None, :], mask=valid[:, None] & in_k[None, :], other=0.0)
            at = tl.load(a_rows[None, :] + k[:, None] * stride_a[3], mask=in_j[None, :] & in_k[:, None], other=0.0)
            acc += mma(xt.to(at.dtype), at, IEEE, UPCAST)  # [BLOCK_M, BLOCK_PR]
        h = h_ptr + tl.program_id(1) * stride_h[0] + place[:, None] * stride_h[1] + j[None, :] * stride_h[2]
        tl.store(h, acc, mask=valid[:, None] & in_j[None, :])


@triton.jit(do_not_specialize=["SPLIT_K"])
def _expand_kernel(
    h_ptr,
    b_ptr,
    y_ptr,
    meta_ptr,
    bounds_ptr,
    stride_h,  # h's 3 strides: split, row, column
    stride_b,  # B's 3 strides
    stride_y,
    ORDER_AT,
    OUT,
    R,
    SPLIT_K,
    H_PART,  # columns between two parts' rank rows in h (R; stacked: slots · R)
    H_SLOT,  # columns between two slots' (0; stacked: R)
    NUM_PARTS: tl.constexpr,
    H_BY_TOKEN: tl.constexpr,  # h's rows are the step's tokens (stacked), not places in `order`
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_PR: tl.constexpr,
    IEEE: tl.constexpr,
    UPCAST: tl.constexpr,
    EMULATE_BF16: tl.constexpr,
    PDL: tl.constexpr,
):
    nb = tl.program_id(1)
    slot, place, token, valid, count = _tile(meta_ptr, ORDER_AT, BLOCK_M)
    j = tl.arange(0, BLOCK_PR)
    in_j = j < NUM_PARTS * R
    n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    in_n = n < OUT
    part = tl.zeros((BLOCK_N,), dtype=tl.int32)  # each column's part
    for p in tl.static_range(1, NUM_PARTS):
        part += (n >= tl.load(bounds_ptr + p)).to(tl.int32)
    own = ((j // R)[:, None] == part[None, :]) & in_j[:, None] & in_n[None, :] & (count > 0)
    b = b_ptr + slot * stride_b[0] + n[None, :] * stride_b[1] + (j % R)[:, None] * stride_b[2]
    bt = tl.load(b, mask=own, other=0.0)  # [BLOCK_PR, BLOCK_N]: Bᵀ of each column's part, zero elsewhere
    wait_for_inputs(PDL)  # B and meta are read-only in a step; h and y come from the kernels before
    if count > 0:
        hsum = tl.zeros((BLOCK_M, BLOCK_PR), dtype=tl.float32)
        h_row = token if H_BY_TOKEN else place
        h_col = (j // R) * H_PART + slot * H_SLOT + j % R
        for s in range(SPLIT_K):
            h = h_ptr + s * stride_h[0] + h_row[:, None] * stride_h[1] + h_col[None, :] * stride_h[2]
            hsum += tl.load(h, mask=valid[:, None] & in_j[None, :], other=0.0).to(tl.float32)
        term = mma(round_to(hsum, b_ptr, EMULATE_BF16), bt, IEEE, UPCAST)
        y = y_ptr + token[:, None] * stride_y + n[None, :]
        mask = valid[:, None] & in_n[None, :]
        out = tl.load(y, mask=mask, other=0.0).to(tl.float32) + term
        tl.store(y, round_to(out, y_ptr, EMULATE_BF16), mask=mask)


def add_lora(
    x: torch.Tensor,
    y: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    bounds: torch.Tensor,
    meta: torch.Tensor,
    order_at: int,
    tile_tokens: int,
    *,
    block_n: int = BLOCK_N,
    block_k: int | None = None,
    splits: int | None = None,
    num_warps: int = 4,
) -> torch.Tensor:
    """y [T, out] += each token's slot's (x·Aᵀ)·Bᵀ, in place (see the module docstring); returns y. The keyword
    arguments are the kernels' tile sizes (`benchmarks/kernels/lora_kernel_bench.py` sweeps them): output columns
    per expand program, the shrink's K block (None: 128 for tiles of at most 16 tokens, else 64), its programs per
    tile (None: `split_k`), warps per program."""
    check_expand(y, a, b, bounds, x.shape[0])
    h = shrink(x, a, meta, order_at, tile_tokens, block_k=block_k, splits=splits, num_warps=num_warps)
    return expand(h, y, b, bounds, meta, order_at, tile_tokens, block_n=block_n, num_warps=num_warps)


def check_expand(y: torch.Tensor, a: torch.Tensor, b: torch.Tensor, bounds: torch.Tensor, tokens: int) -> None:
    """Raises unless y [tokens, out] and B fit A's (parts, slots, rank) and bounds has a bound per part."""
    num_parts, num_slots, rank, _ = a.shape
    if y.dim() != 2 or y.shape[0] != tokens:
        raise ValueError(f"y {tuple(y.shape)} and {tokens} tokens do not fit")
    if b.shape != (num_slots, y.shape[1], rank) or bounds.numel() != num_parts + 1:
        raise ValueError(
            f"B {tuple(b.shape)} / bounds {bounds.numel()} do not fit A {tuple(a.shape)}, y {tuple(y.shape)}"
        )
    if y.dtype not in DTYPES or a.dtype != b.dtype or bounds.dtype != torch.int32:
        raise ValueError(f"dtypes y {y.dtype}, A {a.dtype}, B {b.dtype}, bounds {bounds.dtype}")
    if y.stride(1) != 1:
        raise ValueError("y needs unit stride along its features")


def shrink(
    x: torch.Tensor,
    a: torch.Tensor,
    meta: torch.Tensor,
    order_at: int,
    tile_tokens: int,
    *,
    block_k: int | None = None,
    splits: int | None = None,
    num_warps: int = 4,
    h: torch.Tensor | None = None,
) -> torch.Tensor:
    """The first launch: h [splits, T, P·R] (fp32 partial sums of x·Aᵀ, a token's row at its place in the
    order) for `expand`, which reads the split count from h's shape. h: where to write them (from
    `shrink_buffer` with the same arguments; a caller launching on another stream allocates on its own)."""
    num_parts, num_slots, rank, k = a.shape
    t = x.shape[0]
    if x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"x {tuple(x.shape)} and A {tuple(a.shape)} do not fit")
    if x.dtype not in DTYPES or a.dtype not in DTYPES:
        raise ValueError(f"dtypes x {x.dtype}, A {a.dtype}")
    tiles = _tiles(t, tile_tokens, num_slots)
    if meta.dtype != torch.int32 or order_at < 3 * tiles or meta.numel() < order_at:
        raise ValueError("meta is int32 and holds the tiles of a step this size, then the order")
    if x.stride(1) != 1:
        raise ValueError("x needs unit stride along its features")
    if h is None:
        h = shrink_buffer(x, a, tile_tokens, splits)
    splits = h.shape[0]
    if h.shape != (splits, t, num_parts * rank) or h.dtype != torch.float32 or not h.is_contiguous():
        raise ValueError(f"h {tuple(h.shape)} {h.dtype} and x {tuple(x.shape)} do not fit (see shrink_buffer)")
    if t == 0:
        return h
    block_k = block_k or (2 * BLOCK_K if tile_tokens <= 16 else BLOCK_K)
    k_per_split = triton.cdiv(triton.cdiv(k, splits), block_k) * block_k
    ieee, upcast = dot_flags(a.dtype)
    _shrink_kernel[(tiles, splits)](
        x, a, h, meta, x.stride(0), a.stride(), h.stride(), order_at, k, k_per_split, rank, num_parts,
        BLOCK_M=tile_tokens, BLOCK_PR=_block_pr(num_parts * rank), BLOCK_K=block_k, IEEE=ieee, UPCAST=upcast,
        num_warps=num_warps, **pdl.launch_args(x, policy.LORA_PDL_MAX_ROWS),
    )  # fmt: skip
    return h


def shrink_buffer(
    x: torch.Tensor, a: torch.Tensor, tile_tokens: int, splits: int | None = None, beside_matmul: bool = False
) -> torch.Tensor:
    """An uninitialised h for `shrink` over x's tokens (splits None: `split_k`'s count, for a shrink launched
    beside the layer's matmul or alone)."""
    num_parts, num_slots, rank, k = a.shape
    splits = splits or split_k(_tiles(x.shape[0], tile_tokens, num_slots), k, beside_matmul)
    return torch.empty(splits, x.shape[0], num_parts * rank, dtype=torch.float32, device=x.device)


def expand(
    h: torch.Tensor,
    y: torch.Tensor,
    b: torch.Tensor,
    bounds: torch.Tensor,
    meta: torch.Tensor,
    order_at: int,
    tile_tokens: int,
    *,
    block_n: int = BLOCK_N,
    num_warps: int = 4,
) -> torch.Tensor:
    """The second launch: y += h's partial sums (from `shrink`, same meta) times each token's slot's Bᵀ, in
    place; returns y. The caller checks y and B (`check_expand`)."""
    splits, t, pr = h.shape
    num_slots, out, rank = b.shape
    num_parts = bounds.numel() - 1
    if t != y.shape[0] or pr != num_parts * rank:
        raise ValueError(f"h {tuple(h.shape)}, y {tuple(y.shape)} and B {tuple(b.shape)} do not fit")
    if t == 0:
        return y
    layout = (rank, 0, False)  # h[split, place, p·R + r]
    _launch_expand(h, h.stride(), layout, y, b, bounds, meta, order_at, tile_tokens, splits, block_n, num_warps)
    return y


def expand_stacked(
    y_ext: torch.Tensor,
    b: torch.Tensor,
    bounds: torch.Tensor,
    meta: torch.Tensor,
    order_at: int,
    tile_tokens: int,
    *,
    block_n: int = BLOCK_N,
    num_warps: int = 4,
) -> torch.Tensor:
    """The expand alone, for a layer whose slots' A are stacked under its weight: y_ext [T, out + P·L·R] is x times
    that stacked weight, the layer's output in its first `out` columns and then every (part, slot, rank)'s x·Aᵀ,
    already in the model's dtype (the shrink's rounding). Adds each token's own slot's term into the first `out`
    columns in place and returns them (a view, row stride out + P·L·R)."""
    num_slots, out, rank = b.shape
    num_parts = bounds.numel() - 1
    if y_ext.dim() != 2 or y_ext.shape[1] != out + num_parts * num_slots * rank or y_ext.stride(1) != 1:
        raise ValueError(f"y_ext {tuple(y_ext.shape)} is not the output of B {tuple(b.shape)}'s stacked weight")
    if y_ext.dtype not in DTYPES or b.dtype != y_ext.dtype or bounds.dtype != torch.int32:
        raise ValueError(f"dtypes y_ext {y_ext.dtype}, B {b.dtype}, bounds {bounds.dtype}")
    y, h = y_ext[:, :out], y_ext[:, out:]
    if y_ext.shape[0]:
        strides = (0, y_ext.stride(0), 1)
        layout = (num_slots * rank, rank, True)
        _launch_expand(h, strides, layout, y, b, bounds, meta, order_at, tile_tokens, 1, block_n, num_warps)
    return y


def _launch_expand(
    h: torch.Tensor,
    h_strides: tuple[int, ...],
    h_layout: tuple[int, int, bool],
    y: torch.Tensor,
    b: torch.Tensor,
    bounds: torch.Tensor,
    meta: torch.Tensor,
    order_at: int,
    tile_tokens: int,
    splits: int,
    block_n: int,
    num_warps: int,
) -> None:
    """The expand's launch over y's tokens; h_layout: (H_PART, H_SLOT, H_BY_TOKEN) (see `_expand_kernel`)."""
    num_slots, out, rank = b.shape
    num_parts = bounds.numel() - 1
    tiles = _tiles(y.shape[0], tile_tokens, num_slots)
    ieee, upcast = dot_flags(b.dtype)
    h_part, h_slot, by_token = h_layout
    _expand_kernel[(tiles, triton.cdiv(out, block_n))](
        h, b, y, meta, bounds, h_strides, b.stride(), y.stride(0), order_at, out, rank, splits, h_part, h_slot,
        NUM_PARTS=num_parts, H_BY_TOKEN=by_token, BLOCK_M=tile_tokens, BLOCK_N=block_n,
        BLOCK_PR=_block_pr(num_parts * rank), IEEE=ieee, UPCAST=upcast,
        EMULATE_BF16=interpreting(),  # round_to emulates only where the pointer is bf16
        num_warps=num_warps, **pdl.launch_args(y, policy.LORA_PDL_MAX_ROWS),
    )  # fmt: skip


def _tiles(tokens: int, tile_tokens: int, num_slots: int) -> int:
    """Programs along a launch's first grid axis: enough tiles for the tokens however the slots split them (each
    slot's last tile may be partial)."""
    return triton.cdiv(tokens, tile_tokens) + num_slots


def _block_pr(rank_rows: int) -> int:
    """Rows of the rank operand for every part's rank rows (P·R): a power of two, at least 16 (tl.dot's minimum)."""
    return max(16, triton.next_power_of_2(rank_rows))
