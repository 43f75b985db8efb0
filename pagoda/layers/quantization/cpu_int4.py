"""4-bit weights on the CPU: the linear layers of a GGUF checkpoint stored as 4-bit blocks stay 4-bit.

The GGUF reader (`models/gguf_checkpoint.py`) dequantizes every tensor to float32, and the model loads
those like any checkpoint. A Q4_1 block is 32 consecutive input values w = q·d + m of one output row,
q in 0..15; llama.cpp's quantizer sets m to the block's minimum and d to (max − min)/15, so q = 0 and
q = 15 both occur and the block's own minimum and maximum give m and d back: (w − m)/d rounds to q.
A Q4_0 block is w = (q − 8)·d, its value of largest magnitude at q = 0, which gives d back. A Q4_K block of 256
is eight such 32-value groups, w = q·(d·sc) − dmin·mn with 6-bit sc and mn per group, and its quantizer need not
use level 0 or 15 in a group (a group of positive values keeps mn = 0), so neither reading gives its step back;
the group's smallest gap between distinct values does (any two neighbouring levels present), and the levels then
count from the group's minimum. `find_int4_grid` tries these for every [row, 32 columns] block of a loaded
weight and accepts the layer only when q·d + m gives every loaded value back to float32 rounding, so nothing is
lost in going back to 4 bits. A layer of wider levels (Q8_0's q in −127..127, Q5_0's and Q5_1's in 0..31, one d
and m per 32 inputs: `find_wide_grid`) becomes two such 4-bit layers, its levels' high and low nibbles
(`CpuWideMethod`); Q5_K's 32-value groups are found like Q4_K's. Layers on neither (Q6_K, whose scales change
every 16 inputs, and float tensors) keep their float weight.

A 4-bit layer's matmul:
- up to `policy.CPU_INT4_MAX_ROWS` rows (decode steps of up to that many sequences): PyTorch's CPU int4 kernel
  (`aten._weight_int4pack_mm_for_cpu`, group 32, bf16 activations: its float32 path is ~60x slower):
  each weight is read as half a byte, where a decode step of a float32 model reads four;
- more rows (prefill): the weight dequantized to bf16 for that one matmul (where the CPU multiplies
  bf16 natively; float32 elsewhere), since that kernel's cost grows with the rows faster than a
  dense matmul's.
The kernel's scales and zero points are one [K/32, N, 2] bf16 tensor, w = (q − 8)·scale + zero, so
zero = m + 8·d. `int4_reference` (the float32 weight rebuilt from q, d, m, then F.linear) is what the
tests hold both paths to.

The kernel's packed levels are the layer's only copy of them: the many-row path unpacks them
(`_unpack_levels_t`, checked against the levels when the layer is packed; a torch whose packing differs keeps
a second, plain copy instead).

The LM head of such a model (the embedded one ties it to its Q8_0 embedding, 49,152 x 576) is the largest
matrix a decode step reads: as float32 it is ~40 % of the layers' bytes together. Where the CPU multiplies bf16
natively, `Bf16LMHead` multiplies by a bf16 copy of it (half the bytes, and the bf16 GEMM scales with the rows
where the float32 one does not), then recomputes each row's largest logits in float32, so greedy tokens and the
top log-probabilities stay the float32 head's. Switch: `PAGODA_CPU_BF16_LM_HEAD=0`. Steps of a few rows
(`policy.CPU_INT8_HEAD_MAX_ROWS`) multiply by an int8 copy with one scale per vocabulary row instead, PyTorch's
int8 weight kernel reading a quarter of float32's bytes; the same recomputation follows. Switch:
`PAGODA_CPU_INT8_LM_HEAD=0`.

A Q8_0 embedding (32 values w = q·d per block, q an int8 in −127..127, d the block's largest magnitude / 127)
goes back to its levels and scales the same way (`find_int8_grid`: every value given back exactly, or the
tensor stays float). `Int8Rows` widens the rows a step looks up, and the bf16 head's exact recomputation reads
its rows from it, so the float32 matrix (a quarter of the embedded model's resident weights) is dropped: the
float32 products q·d are the values the GGUF's own dequantization gives, bit for bit. With a tied head that
multiplies in float32 (no native bf16) the float matrix is needed anyway and the embedding stays float.
"""

from __future__ import annotations

import abc
import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F

from pagoda import envs
from pagoda.kernels import policy
from pagoda.layers.linear import Linear
from pagoda.layers.vocab_parallel import ParallelLMHead, VocabParallelEmbedding
from pagoda.serving_gc import return_freed_memory

GROUP = 32  # GGUF's block: 32 input values per scale and minimum


def available() -> bool:
    """This torch build has the CPU int4 kernel."""
    ops = torch.ops.aten
    return hasattr(ops, "_weight_int4pack_mm_for_cpu") and hasattr(ops, "_convert_weight_to_int4pack_for_cpu")


def int8_head_available() -> bool:
    """This torch build has the CPU int8 weight kernel (and the switch leaves it on)."""
    return envs.CPU_INT8_LM_HEAD.value and hasattr(torch.ops.aten, "_weight_int8pack_mm")


@functools.cache
def native_bf16() -> bool:
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def _levels(w: torch.Tensor, d: torch.Tensor, m: torch.Tensor, top: int = 15) -> tuple[torch.Tensor, torch.Tensor]:
    """(q in 0..top, whether q·d + m gives each [.., 32] block back to float32 rounding) for blocks w [R, G, 32]."""
    safe = torch.where(d != 0, d, torch.ones_like(d))  # a constant block: every q is 0
    q = (w - m).div_(safe).round_().clamp_(0, top)  # in place: a layer's weights pass through here once or twice
    tolerance = 4 * torch.finfo(torch.float32).eps * w.abs().amax(-1, keepdim=True)
    return q, (q * d).add_(m).sub_(w).abs_().le_(tolerance).all(-1, keepdim=True)


def _smallest_step(w: torch.Tensor, low: torch.Tensor, high: torch.Tensor) -> torch.Tensor:
    """For blocks w [R, G, 32]: (max − min) / s, s the whole number of the block's smallest gap between distinct
    values in its span (gaps within float32 rounding are equal values); 0 for a block of one value. Measuring
    the step over the whole span keeps its rounding error a span's, not a gap's."""
    gaps = w.sort(-1).values.diff(dim=-1)
    tolerance = 4 * torch.finfo(torch.float32).eps * w.abs().amax(-1, keepdim=True)
    gap = torch.where(gaps > tolerance, gaps, torch.full_like(gaps, float("inf"))).amin(-1, keepdim=True)
    span = high - low
    steps = torch.round(span / gap).clamp_(min=1)  # a block of one value: inf gap, 0 / 1 below
    return torch.where(torch.isfinite(gap), span / steps, torch.zeros_like(span))


def _affine_grid(weight: torch.Tensor, top: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """(q uint8 [N, K] in 0..top, d [N, K/32], m [N, K/32]) with weight == q·d + m to float32 rounding, or None when
    some block is on no grid of top + 1 levels. Tried in turn for each block: llama.cpp's _1 formats' (m = the
    block's minimum, d = (max − min)/top), its _0 formats' (w = (q − h)·d, h = (top + 1)/2, with d = −x/h for the
    block's value x of largest magnitude, which llama.cpp puts at q = 0), then any top + 1 levels (m = the
    minimum, d = its smallest step: the K-quants' groups)."""
    n, k = weight.shape
    if k % GROUP:
        return None
    w = weight.detach().float().reshape(n, k // GROUP, GROUP)
    low, high = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
    d1 = (high - low) / top
    q1, fits1 = _levels(w, d1, low, top)
    if bool(fits1.all()):  # every block a _1 format's (the embedded model's Q4_1): the other readings would not be used
        return q1.to(torch.uint8).reshape(n, k), d1.squeeze(-1), low.squeeze(-1)
    extreme = w.gather(-1, w.abs().argmax(-1, keepdim=True))
    d0 = -extreme / ((top + 1) // 2)
    q0, fits0 = _levels(w, d0, extreme, top)
    q, d, m = torch.where(fits1, q1, q0), torch.where(fits1, d1, d0), torch.where(fits1, low, extreme)
    fits = fits1 | fits0
    if not bool(fits.all()):
        step = _smallest_step(w, low, high)
        q_any, fits_any = _levels(w, step, low, top)  # levels past the top are clamped, so they fail the check
        q, d, m = torch.where(fits, q, q_any), torch.where(fits, d, step), torch.where(fits, m, low)
        if not bool((fits | fits_any).all()):
            return None
    return q.to(torch.uint8).reshape(n, k), d.squeeze(-1), m.squeeze(-1)


def find_int4_grid(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """(q uint8 [N, K] in 0..15, d, m) on Q4_1's, Q4_0's or Q4_K's grid (`_affine_grid`), or None."""
    return _affine_grid(weight, 15)


def int4_reference(x: torch.Tensor, q: torch.Tensor, d: torch.Tensor, m: torch.Tensor, bias: torch.Tensor | None):
    """x · Wᵀ (+ bias) with W = q·d + m rebuilt in float32: [T, K] → [T, N]."""
    n, k = q.shape
    weight = (q.float().reshape(n, k // GROUP, GROUP) * d[..., None] + m[..., None]).reshape(n, k)
    return F.linear(x.float(), weight, None if bias is None else bias.float()).to(x.dtype)


def _unpack_levels_t(packed: torch.Tensor, n: int, k: int, dtype: torch.dtype) -> torch.Tensor:
    """The levels q, transposed, as [K, N] of `dtype`, from `_convert_weight_to_int4pack_for_cpu`'s bytes: blocks of
    64 output columns, each [K, 32] bytes whose low nibble is column j of the block and high nibble column j + 32
    (K-major already, so each block's bytes land in place); a last block of fewer columns (N is a multiple of 16)
    is [K, width / 2] bytes holding columns 2j and 2j + 1."""
    flat = packed.reshape(-1)
    full = n // 64 * 64
    out = torch.empty(k, n, dtype=dtype)
    if full:
        blocks = flat[: full * k // 2].view(full // 64, k, 32).permute(1, 0, 2)  # [K, N/64, 32]
        body = out[:, :full].view(k, full // 64, 2, 32)
        body[:, :, 0] = blocks & 15
        body[:, :, 1] = blocks >> 4
    if full < n:
        tail = flat[full * k // 2 :].view(k, (n - full) // 2)
        pairs = out[:, full:].view(k, (n - full) // 2, 2)
        pairs[..., 0] = tail & 15
        pairs[..., 1] = tail >> 4
    return out


class _CpuPackedMethod(abc.ABC):
    """A `Linear.quant` that multiplies few rows through PyTorch's CPU int4 kernel and more rows by its weight
    dequantized for that matmul. Subclasses give `shape` (N, K), `prefill_dtype`, `few_rows` and `dequantized_t`."""

    shape: tuple[int, int]
    prefill_dtype: torch.dtype

    @abc.abstractmethod
    def few_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """rows [M, K] (M ≤ `policy.CPU_INT4_MAX_ROWS`) · Wᵀ through the int4 kernel, in rows' dtype."""

    @abc.abstractmethod
    def dequantized_t(self) -> torch.Tensor:
        """Wᵀ [K, N] in `prefill_dtype`, for the many-row matmul."""

    def apply(self, layer: Linear, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        flat = x.dim() == 2  # [T, K], as a step's activations are: no reshapes on the decode path
        rows = x if flat else x.reshape(-1, x.shape[-1])
        if rows.shape[0] <= policy.CPU_INT4_MAX_ROWS:
            y = self.few_rows(rows)
        else:
            y = torch.mm(rows.to(self.prefill_dtype), self.dequantized_t()).to(x.dtype)
        if not flat:
            y = y.reshape(*x.shape[:-1], self.shape[0])
        return y if bias is None else y + bias

    def gemv_operands(self, layer: Linear) -> None:
        return None  # the GPU's GEMV kernels read float weights


class CpuInt4Method(_CpuPackedMethod):
    """`Linear.quant` of one layer whose weight went back to 4 bits (`pack_int4_layers`)."""

    def __init__(self, q: torch.Tensor, d: torch.Tensor, m: torch.Tensor):
        n, k = q.shape
        self.shape = (n, k)
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 2)
        # [K/32, N, 2]: the kernel's (scale, zero) per group and column, w = (q − 8)·scale + zero.
        self.scales_zeros = torch.stack((d, m + 8 * d), -1).transpose(0, 1).contiguous().to(torch.bfloat16)
        # For the many-row path: the levels come from `packed`, unless this torch packs them another way;
        # then a plain copy, two to a byte (low nibble first).
        same = torch.equal(_unpack_levels_t(self.packed, n, k, torch.uint8), q.t())
        self.nibbles = None if same else (q[:, 0::2] | (q[:, 1::2] << 4)).contiguous()
        self.prefill_dtype = torch.bfloat16 if native_bf16() else torch.float32
        # [K/32, 1, N]: each group's scale and minimum laid out like the transposed weight they multiply.
        self.d_t = d.t().contiguous().to(self.prefill_dtype)[:, None, :]
        self.m_t = m.t().contiguous().to(self.prefill_dtype)[:, None, :]

    def levels_t(self, dtype: torch.dtype) -> torch.Tensor:
        """The levels q, transposed, [K, N] of `dtype`."""
        n, k = self.shape
        if self.nibbles is None:
            return _unpack_levels_t(self.packed, n, k, dtype)
        q = torch.empty(n, k, dtype=torch.uint8)
        torch.bitwise_and(self.nibbles, 15, out=q[:, 0::2])
        torch.bitwise_right_shift(self.nibbles, 4, out=q[:, 1::2])
        return torch.empty(k, n, dtype=dtype).copy_(q.t())

    def dequantized_t(self) -> torch.Tensor:
        """Wᵀ [K, N] in `prefill_dtype` (exact levels; d and m rounded to it; q·d + m rounded once). Transposed
        because the kernel packs K-major: the levels unpack in place, and the scales broadcast along whole rows."""
        n, k = self.shape
        grouped = self.levels_t(self.prefill_dtype).view(k // GROUP, GROUP, n)
        return torch.addcmul(self.m_t, grouped, self.d_t, out=grouped).view(k, n)

    def products(self, rows_bf16: torch.Tensor) -> torch.Tensor:
        """rows [M, K] bf16 · Wᵀ through the int4 kernel → [M, N] bf16."""
        return torch.ops.aten._weight_int4pack_mm_for_cpu(rows_bf16, self.packed, GROUP, self.scales_zeros)

    def few_rows(self, rows: torch.Tensor) -> torch.Tensor:
        return self.products(rows.to(torch.bfloat16)).to(rows.dtype)


def find_wide_grid(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """(q uint8 [N, K] in 0..255, d [N, K/32], m [N, K/32]) with weight == q·d + m to float32 rounding, or None: every
    block on a grid of 32 levels (Q5_1's, Q5_0's or Q5_K's, `_affine_grid`), or else the whole layer on Q8_0's
    (`find_int8_grid`, its q + 128 from m = −128·d)."""
    if (grid := _affine_grid(weight, 31)) is not None:
        return grid
    if (levels := find_int8_grid(weight)) is None:
        return None
    q8, d8 = levels
    return (q8.to(torch.int16) + 128).to(torch.uint8), d8, -128 * d8


class CpuWideMethod(_CpuPackedMethod):
    """`Linear.quant` of a layer of up to 8-bit levels (`find_wide_grid`: W = q·d + m, q in 0..255, one d and m per
    32 inputs: Q8_0, Q5_0, Q5_1, Q5_K) held as two 4-bit layers over its own scales: q = 16·hi + lo with hi and lo in
    0..15, so W = hi·(16·d) + m + lo·d, each half exactly the int4 kernel's (q' − 8)·scale + zero form. The high
    levels are moved to the middle of 0..15 (5-bit levels have hi in 0..1: stored as 7..8), so that the kernel's
    bf16 zero point stays near the values it offsets instead of cancelling against 8 scales. A step of few rows
    reads a byte a weight (two half-byte passes) where the float32 weight is four; the two products are added in
    float32."""

    def __init__(self, q: torch.Tensor, d: torch.Tensor, m: torch.Tensor):
        self.shape = (q.shape[0], q.shape[1])
        shift = 8 - ((int(q.max()) >> 4) + 1) // 2
        self.high = CpuInt4Method((q >> 4) + shift, 16 * d, m - shift * 16 * d)
        self.low = CpuInt4Method(q & 15, d, torch.zeros_like(d))
        self.prefill_dtype = self.low.prefill_dtype
        # For the many-row path, in float32 (the halves' bf16 d and m would cancel): [K/32, 1, N], the levels
        # rebuilt as 16·(hi + shift) + lo.
        self.d_t = d.t().contiguous()[:, None, :]
        self.m_t = (m - shift * 16 * d).t().contiguous()[:, None, :]

    def few_rows(self, rows: torch.Tensor) -> torch.Tensor:
        x = rows.to(torch.bfloat16)  # once for both halves
        return torch.add(self.high.products(x).float(), self.low.products(x).float()).to(rows.dtype)

    def dequantized_t(self) -> torch.Tensor:
        """Wᵀ [K, N] in `prefill_dtype`: q·d + m in float32 from the exact levels, rounded once."""
        n, k = self.shape
        levels = self.high.levels_t(torch.float32).mul_(16).add_(self.low.levels_t(torch.float32))
        grouped = levels.view(k // GROUP, GROUP, n)
        return torch.addcmul(self.m_t, grouped, self.d_t, out=grouped).view(k, n).to(self.prefill_dtype)


def pack_int4_layers(model: torch.nn.Module) -> tuple[int, int, int]:
    """Give every plain linear layer whose float32 weight is on a 4-bit grid a `CpuInt4Method`, and every one on
    a grid of up to 8 bits (Q8_0, Q5_0, Q5_1, Q5_K) a `CpuWideMethod` (their float weights dropped). Returns
    (layers 4-bit, layers of wider levels, linear layers left as they were)."""
    counts = [0, 0, 0]
    for module in model.modules():
        if not isinstance(module, Linear) or module.quant is not None:
            continue
        weight = getattr(module, "weight", None)
        method: _CpuPackedMethod | None = None
        if isinstance(weight, torch.Tensor) and weight.dim() == 2 and weight.device.type == "cpu":
            try:
                if (grid := find_int4_grid(weight)) is not None:
                    method = CpuInt4Method(*grid)
                elif (wide := find_wide_grid(weight)) is not None:
                    method = CpuWideMethod(*wide)
            except RuntimeError:  # a shape the kernel's packing refuses
                method = None
        counts[2 if method is None else 0 if isinstance(method, CpuInt4Method) else 1] += 1
        if method is not None:
            module.quant = method
            del module.weight
    if counts[0] or counts[1]:
        return_freed_memory()  # the float32 weights' heap (glibc keeps it otherwise: ~100 MB for the embedded model)
    return counts[0], counts[1], counts[2]


class Bf16LMHead:
    """An LM head multiplied by a bf16 copy of its weight, then the `policy.CPU_BF16_HEAD_EXACT` largest logits of
    each row recomputed in float32 from the float weight: the bf16 rounding moves every logit a little, enough to
    swap two nearly tied candidates, so the ones greedy decoding and the reported log-probabilities look at are
    the float32 head's own."""

    def __init__(self, weight: torch.Tensor):
        # The float32 rows by vocabulary index: the weight itself (shared with a tied embedding, not a copy),
        # or a tied Q8_0 embedding's `Int8Rows` once that replaces it (`int8_embeddings`).
        self.exact_rows: Callable[[torch.Tensor], torch.Tensor] = weight.__getitem__
        self.weight = weight.detach().to(torch.bfloat16)
        # Steps of at most policy.CPU_INT8_HEAD_MAX_ROWS rows multiply by an int8 copy, one scale per vocabulary
        # row (a quarter of float32's bytes; PyTorch's int8 kernel, bf16 activations): the head is one pass
        # over memory there, and the exact recomputation below makes its coarser rounding harmless too.
        self.levels, self.row_scales = None, None
        if int8_head_available():
            w = weight.detach().float()
            scales = w.abs().amax(1) / 127
            self.levels = torch.round(w / torch.where(scales > 0, scales, 1.0)[:, None]).to(torch.int8)
            self.row_scales = scales.to(torch.bfloat16)

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        assert bias is None, "an LM head has no bias"
        rows = x.reshape(-1, x.shape[-1])
        if self.levels is not None and rows.shape[0] <= policy.CPU_INT8_HEAD_MAX_ROWS:
            y = torch.ops.aten._weight_int8pack_mm(rows.to(torch.bfloat16), self.levels, self.row_scales)
            y = y.to(x.dtype).reshape(*x.shape[:-1], -1)
        else:
            y = F.linear(x.to(torch.bfloat16), self.weight).to(x.dtype)
        top = y.topk(min(policy.CPU_BF16_HEAD_EXACT, y.shape[-1]), dim=-1).indices  # [N, k]
        exact = torch.einsum("nh,nkh->nk", x, self.exact_rows(top)).to(y.dtype)  # [N, k]
        return y.scatter_(-1, top, exact)

    def gemv_operands(self, layer: Linear) -> None:
        return None


def bf16_lm_heads(model: torch.nn.Module) -> int:
    """Give every float32 CPU LM head a `Bf16LMHead`; returns how many. Only where bf16 is native (elsewhere a
    bf16 matmul is slower than float32's)."""
    if not native_bf16():
        return 0
    heads = 0
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if isinstance(module, ParallelLMHead) and isinstance(weight, torch.Tensor) and module.quant is None:
            if weight.dtype == torch.float32 and weight.device.type == "cpu":
                module.quant = Bf16LMHead(weight)
                heads += 1
    return heads


def find_int8_grid(weight: torch.Tensor, chunk: int = 4096) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(q int8 [V, H], d float32 [V, H/32]) with weight == q·d exactly, d = the block's largest magnitude / 127
    (Q8_0's), or None when some block is not on that grid. Checked `chunk` rows at a time: the check's float
    temporaries stay a few MB beside a ~100 MB matrix."""
    v, h = weight.shape
    if h % GROUP:
        return None
    levels = torch.empty(v, h, dtype=torch.int8)
    scales = torch.empty(v, h // GROUP, dtype=torch.float32)
    for r0 in range(0, v, chunk):
        w = weight[r0 : r0 + chunk].detach().float().reshape(-1, h // GROUP, GROUP)
        d = w.abs().amax(-1, keepdim=True) / 127
        q = torch.round(w / torch.where(d != 0, d, torch.ones_like(d))).clamp_(-127, 127)
        if not torch.equal(q * d, w):
            return None
        levels[r0 : r0 + chunk] = q.reshape(-1, h).to(torch.int8)
        scales[r0 : r0 + chunk] = d.squeeze(-1)
    return levels, scales


class Int8Rows:
    """An embedding kept as its Q8_0 levels and scales: `rows(ids)` [..] → the float32 rows [.., H], bit for bit
    the GGUF's dequantized values."""

    def __init__(self, levels: torch.Tensor, scales: torch.Tensor):
        self.levels, self.scales = levels, scales  # int8 [V, H], float32 [V, H/32]

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.levels.shape[1]
        rows = self.levels[ids].reshape(-1, h // GROUP, GROUP).float() * self.scales[ids].reshape(-1, h // GROUP, 1)
        return rows.reshape(*ids.shape, h)


def int8_embeddings(model: torch.nn.Module) -> int:
    """Give every float32 CPU embedding on the Q8_0 grid `Int8Rows` and drop its float matrix (from a tied LM head
    too, whose `Bf16LMHead` then reads its exact rows there); returns how many. An embedding tied to a head that
    multiplies by the float matrix stays float."""
    heads = [m for m in model.modules() if isinstance(m, ParallelLMHead)]
    done = 0
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if not isinstance(module, VocabParallelEmbedding) or not isinstance(weight, torch.Tensor):
            continue
        if weight.dtype != torch.float32 or weight.device.type != "cpu":
            continue
        tied = [head for head in heads if getattr(head, "weight", None) is weight]
        if any(not isinstance(head.quant, Bf16LMHead) for head in tied):
            continue
        grid = find_int8_grid(weight)
        if grid is None:
            continue
        module.rows = Int8Rows(*grid)
        for head in tied:
            assert isinstance(head.quant, Bf16LMHead)
            head.quant.exact_rows = module.rows
            del head.weight
        del module.weight
        done += 1
    if done:
        return_freed_memory()  # the float32 weights' heap (glibc keeps it otherwise: ~100 MB for the embedded model)
    return done
