"""4-bit weight-only quantization (AWQ, GPTQ): the checkpoints' layouts, Pagoda's one layout, references.

Why: AutoAWQ and AutoGPTQ store the same information — a 4-bit integer q per weight, and a scale and
an integer zero point per (group of input rows, output column) — packed in two different ways. Both
are converted once, when loaded, into one layout, so one kernel (`pagoda/kernels/int4_gemm.py`)
serves both.

Pagoda's layout, for a linear layer y = x·Wᵀ (+ bias) with x [M, K] and W [N, K]:
- qweight int32 [K/8, N], packed along K: nibble j (bits 4j..4j+3) of qweight[r, n] is q[8r + j, n];
- scales [G, N] and zeros [G, N]: group g's scale and integer zero point for column n (the zero
  points as floats: small integers, exact in every float dtype);
- g_idx int32 [K]: the group of each input row;
so that W[n, k] = (q[k, n] − zeros[g_idx[k], n]) · scales[g_idx[k], n].

The checkpoint layouts, as the exporters write them (G = group size, -1: one group over all of K):
- AWQ (AutoAWQ, version "gemm"): qweight int32 [K, N/8], packed along N with the columns
  interleaved: nibble i of qweight[k, c] holds column 8c + AWQ_PACK_ORDER[i]; qzeros int32
  [K/G, N/8] packed the same way, holding the zero points themselves; scales [K/G, N]. Group g is
  rows [g·G, (g+1)·G).
- GPTQ (AutoGPTQ): qweight int32 [K/8, N], packed along K as in Pagoda's layout; qzeros int32
  [K/G, N/8] packed along N in plain order (nibble j of qzeros[g, c] is column 8c + j); scales
  [K/G, N]; g_idx int32 [K]. Act-order ("desc_act") exports assign the rows to groups in a permuted
  order, so g_idx[k] need not be k // G (every group still has G rows). checkpoint_format "gptq"
  (v1) stores zero point − 1 in qzeros and the readers add the 1 back after masking the nibble, so
  v1 reads zero points 1..16 and cannot hold a 0 (AutoGPTQ's v1 packer writes 0 − 1 unmasked, which
  corrupts the group's other seven nibbles); "gptq_v2" stores the zero point itself. Symmetric
  exports have zero point 8 everywhere (v1 stores 7); it is read from qzeros like any other.

Numerics: the conversions move integers between layouts and are exact. Dequantizing is exact in fp32
(an integer of magnitude ≤ 16 times a bf16/fp16 scale fits in fp32's significand); the reference
matmul then rounds W to x's dtype and calls F.linear, which is what an unquantized layer holding that
W computes.

The quantizers (`quantize_awq`, `quantize_gptq`) build checkpoints for tests: round to nearest per
group over [min(w, 0), max(w, 0)] (zero inside the grid, so no weight is clipped by more than half a
step), not the AWQ / GPTQ search; the layouts are the exporters'. `dequantize_awq_checkpoint` and
`dequantize_gptq_checkpoint` read a checkpoint directly, one nibble position at a time, without
the conversion helpers: the independent side of the conversion tests.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

PACK = 8  # 4-bit values per int32
AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of an AWQ int32 holds column AWQ_PACK_ORDER[i] of its eight
_PLAIN_ORDER = tuple(range(PACK))
_MAXQ = 15
_CHECKPOINT_FORMATS = ("gptq", "gptq_v2")


def _group_rows(group_size: int, k: int) -> int:
    """Rows per group: group_size, or all of K for -1 (any value ≤ 0)."""
    return k if group_size <= 0 else group_size


def _check_groups(groups: int, group: int, k: int, what: str) -> None:
    if groups * group < k:
        raise ValueError(f"{what} has {groups} groups: too few for {k} input rows in groups of {group}")


def _pack_rows(q: torch.Tensor) -> torch.Tensor:
    """q [R, C] of 0..15 → int32 [R/8, C]: nibble j of out[r, c] is q[8r + j, c]. (PyTorch's int32
    shifts wrap, so nibble 7 lands in the sign bit as the exporters' words have it.)"""
    packed = torch.zeros(q.shape[0] // PACK, q.shape[1], dtype=torch.int32, device=q.device)
    for j in range(PACK):
        packed |= q[j::PACK].to(torch.int32) << (4 * j)
    return packed


def _pack_columns(q: torch.Tensor, order: tuple[int, ...]) -> torch.Tensor:
    """q [R, C] of 0..15 → int32 [R, C/8]: nibble i of out[r, c] is q[r, 8c + order[i]]."""
    packed = torch.zeros(q.shape[0], q.shape[1] // PACK, dtype=torch.int32, device=q.device)
    for i, column in enumerate(order):
        packed |= q[:, column::PACK].to(torch.int32) << (4 * i)
    return packed


def _unpack_rows(packed: torch.Tensor) -> torch.Tensor:
    """int32 [R/8, C] packed along rows → uint8 [R, C] (the inverse of `_pack_rows`). One nibble
    position at a time: the temporaries stay at half a byte per weight (layers are unpacked on the GPU)."""
    out = torch.empty(packed.shape[0], PACK, packed.shape[1], dtype=torch.uint8, device=packed.device)
    for j in range(PACK):
        out[:, j] = (packed >> (4 * j)) & _MAXQ
    return out.view(packed.shape[0] * PACK, packed.shape[1])


def _unpack_columns(packed: torch.Tensor, order: tuple[int, ...]) -> torch.Tensor:
    """int32 [R, C/8] packed along columns → uint8 [R, C] (the inverse of `_pack_columns`)."""
    out = torch.empty(packed.shape[0], packed.shape[1], PACK, dtype=torch.uint8, device=packed.device)
    for i, column in enumerate(order):
        out[:, :, column] = (packed >> (4 * i)) & _MAXQ
    return out.view(packed.shape[0], packed.shape[1] * PACK)


def _rows_in_order(k: int, group: int, device: torch.device) -> torch.Tensor:
    return (torch.arange(k, device=device) // group).to(torch.int32)


def awq_to_internal(
    qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """An AWQ "gemm" checkpoint's qweight [K, N/8], qzeros [K/G, N/8], scales [K/G, N] → Pagoda's
    (qweight int32 [K/8, N], scales as given, zeros float32 [K/G, N], g_idx int32 [K])."""
    k, n = qweight.shape[0], qweight.shape[1] * PACK
    if k % PACK:
        raise ValueError(f"AWQ qweight has {k} input rows, not a multiple of {PACK}")
    if qzeros.shape[1] * PACK != n or scales.shape[1] != n or qzeros.shape[0] != scales.shape[0]:
        raise ValueError(
            f"AWQ tensors disagree: qweight {tuple(qweight.shape)}, qzeros {tuple(qzeros.shape)}, "
            f"scales {tuple(scales.shape)}"
        )
    group = _group_rows(group_size, k)
    _check_groups(scales.shape[0], group, k, "AWQ scales")
    internal = _pack_rows(_unpack_columns(qweight, AWQ_PACK_ORDER))
    zeros = _unpack_columns(qzeros, AWQ_PACK_ORDER).to(torch.float32)
    return internal, scales, zeros, _rows_in_order(k, group, qweight.device)


def gptq_to_internal(
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    g_idx: torch.Tensor | None,
    *,
    bits: int,
    sym: bool,
    checkpoint_format: str,
    group_size: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A GPTQ checkpoint's qweight [K/8, N], qzeros [K/G, N/8], scales [K/G, N], g_idx [K] (None: rows
    in order, group k // group_size) → Pagoda's (qweight, scales as given, zeros float32, g_idx int32).

    sym is accepted for the config's sake: a symmetric export's qzeros hold its zero points (8) like
    any other's, and they are read from there."""
    del sym
    if bits != 4:
        raise ValueError(f"only 4-bit GPTQ weights are supported, got bits={bits}")
    if checkpoint_format not in _CHECKPOINT_FORMATS:
        raise ValueError(f"checkpoint_format must be one of {_CHECKPOINT_FORMATS}, got {checkpoint_format!r}")
    k, n = qweight.shape[0] * PACK, qweight.shape[1]
    if qzeros.shape[1] * PACK != n or scales.shape[1] != n or qzeros.shape[0] != scales.shape[0]:
        raise ValueError(
            f"GPTQ tensors disagree: qweight {tuple(qweight.shape)}, qzeros {tuple(qzeros.shape)}, "
            f"scales {tuple(scales.shape)}"
        )
    if g_idx is None:
        group = _group_rows(group_size, k)
        _check_groups(scales.shape[0], group, k, "GPTQ scales")
        g_idx = _rows_in_order(k, group, qweight.device)
    elif g_idx.shape != (k,):
        raise ValueError(f"GPTQ g_idx must be [{k}], got {tuple(g_idx.shape)}")
    zeros = _unpack_columns(qzeros, _PLAIN_ORDER).to(torch.float32)
    if checkpoint_format == "gptq":
        zeros += 1
    return qweight, scales, zeros, g_idx.to(torch.int32)


def dequantize(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, g_idx: torch.Tensor) -> torch.Tensor:
    """Pagoda's layout → W [N, K] float32 (a transposed view of Wᵀ [K, N], as F.linear takes it)."""
    rows = g_idx.long()
    q = _unpack_rows(qweight).to(torch.float32)
    return ((q - zeros.float()[rows]) * scales.float()[rows]).t()


def int4_matmul_reference(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    g_idx: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """F.linear(x, W, bias) for x [M, K] with W dequantized (exactly, in fp32) then rounded to x's dtype
    → [M, N] in x's dtype. Float64 x gives the exact result of the quantized weights."""
    weight = dequantize(qweight, scales, zeros, g_idx).to(x.dtype)
    return F.linear(x, weight, None if bias is None else bias.to(x.dtype))


# ---------------------------------------------------------------------------------------------
# Checkpoints read directly, and built (tests)
# ---------------------------------------------------------------------------------------------


def _nibble(words: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
    """(words >> 4·position) & 15 elementwise, as float32."""
    return ((words >> (4 * position)) & _MAXQ).to(torch.float32)


def _weight_from_rows(q: torch.Tensor, z: torch.Tensor, s: torch.Tensor, groups: torch.Tensor) -> torch.Tensor:
    """Wᵀ[k, n] = (q[k, n] − z[groups[k], n]) · s[groups[k], n] → W [N, K] float32."""
    return ((q - z[groups]) * s.float()[groups]).t().contiguous()


def dequantize_awq_checkpoint(
    qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group_size: int
) -> torch.Tensor:
    """An AWQ "gemm" checkpoint → W [N, K] float32, each element read from its own word and nibble."""
    k, n = qweight.shape[0], qweight.shape[1] * PACK
    column = torch.arange(n, device=qweight.device)
    position = torch.tensor([AWQ_PACK_ORDER.index(c) for c in range(PACK)], device=qweight.device)[column % PACK]
    q = _nibble(qweight[:, column // PACK], position[None, :])
    z = _nibble(qzeros[:, column // PACK], position[None, :])
    groups = torch.arange(k, device=qweight.device) // _group_rows(group_size, k)
    return _weight_from_rows(q, z, scales, groups)


def dequantize_gptq_checkpoint(
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    g_idx: torch.Tensor | None,
    *,
    group_size: int,
    checkpoint_format: str = "gptq",
) -> torch.Tensor:
    """A GPTQ checkpoint → W [N, K] float32, each element read from its own word and nibble; g_idx
    None: rows in order."""
    k, n = qweight.shape[0] * PACK, qweight.shape[1]
    row = torch.arange(k, device=qweight.device)
    column = torch.arange(n, device=qweight.device)
    q = _nibble(qweight[row // PACK, :], (row % PACK)[:, None])
    z = _nibble(qzeros[:, column // PACK], (column % PACK)[None, :]) + (1 if checkpoint_format == "gptq" else 0)
    groups = row // _group_rows(group_size, k) if g_idx is None else g_idx.long()
    return _weight_from_rows(q, z, scales, groups)


def _grid(lo: torch.Tensor, hi: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-group scale (fp16) and zero point for [lo, hi] ∋ 0 on 0..15: the scale is rounded up to
    fp16, never down, so the grid still covers [lo, hi]."""
    exact = ((hi - lo) / _MAXQ).clamp_min(1e-5)
    scale = exact.half()
    too_small = scale.float() < exact
    scale = torch.where(too_small, (scale.float() * (1 + 2.0**-10)).half(), scale)
    zero = torch.round(-lo / scale.float()).clamp(0, _MAXQ)
    return scale, zero


def _quantize_rows(wt: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """wt [K, N] with each row's scale and zero point [K, N] → q [K, N] of 0..15."""
    return (torch.round(wt / scale.float()) + zero).clamp(0, _MAXQ).to(torch.int64)


def quantize_awq(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """W [N, K] (nn.Linear's layout) → an AWQ "gemm" checkpoint (qweight [K, N/8], qzeros [K/G, N/8],
    scales fp16 [K/G, N]), asymmetric, rounded to nearest per group."""
    n, k = weight.shape
    group = _group_rows(group_size, k)
    if k % group or n % PACK or k % PACK:
        raise ValueError(f"cannot quantize a [{n}, {k}] weight in groups of {group} rows, packed by {PACK}")
    wt = weight.detach().float().t()  # [K, N]
    grouped = wt.reshape(k // group, group, n)
    scale, zero = _grid(grouped.amin(dim=1).clamp_max(0), grouped.amax(dim=1).clamp_min(0))
    q = _quantize_rows(wt, scale.repeat_interleave(group, dim=0), zero.repeat_interleave(group, dim=0))
    return (
        _pack_columns(q, AWQ_PACK_ORDER),
        _pack_columns(zero.to(torch.int64), AWQ_PACK_ORDER),
        scale,
    )


def quantize_gptq(
    weight: torch.Tensor,
    group_size: int,
    *,
    sym: bool = True,
    act_order: bool = False,
    checkpoint_format: str = "gptq",
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """W [N, K] → a 4-bit GPTQ checkpoint (qweight [K/8, N], qzeros [K/G, N/8], scales fp16 [K/G, N],
    g_idx int32 [K]), rounded to nearest per group.

    sym: zero point 8 and the scale of max |w| over 7.5 (AutoGPTQ's symmetric grid); else min/max.
    act_order: rows go to groups in a random permutation's order (seeded), as desc_act exports
    assign them, so g_idx is not k // G. v1 ("gptq") cannot store a zero point of 0: such a group's
    grid moves to zero point 1, its scale widened to still reach the group's maximum."""
    if checkpoint_format not in _CHECKPOINT_FORMATS:
        raise ValueError(f"checkpoint_format must be one of {_CHECKPOINT_FORMATS}, got {checkpoint_format!r}")
    n, k = weight.shape
    group = _group_rows(group_size, k)
    if k % group or n % PACK or k % PACK:
        raise ValueError(f"cannot quantize a [{n}, {k}] weight in groups of {group} rows, packed by {PACK}")
    wt = weight.detach().float().t().cpu()  # [K, N]
    if act_order:
        order = torch.randperm(k, generator=torch.Generator().manual_seed(seed))  # group g: rows order[gG:(g+1)G]
    else:
        order = torch.arange(k)
    g_idx = torch.empty(k, dtype=torch.int32)
    g_idx[order] = (torch.arange(k) // group).to(torch.int32)
    grouped = wt[order].reshape(k // group, group, n)
    lo, hi = grouped.amin(dim=1).clamp_max(0), grouped.amax(dim=1).clamp_min(0)
    if sym:
        hi = torch.maximum(hi, -lo)
        scale, _ = _grid(-hi, hi)
        zero = torch.full_like(hi, (_MAXQ + 1) // 2)
    else:
        scale, zero = _grid(lo, hi)
        if checkpoint_format == "gptq":
            widened, _ = _grid(torch.zeros_like(hi), hi * _MAXQ / (_MAXQ - 1))  # hi at q = 15 from zero point 1
            scale = torch.where(zero == 0, torch.maximum(scale.float(), widened.float()).half(), scale)
            zero = zero.clamp_min(1)
    rows = g_idx.long()
    q = _quantize_rows(wt, scale[rows], zero[rows])
    stored = zero.to(torch.int64) - (1 if checkpoint_format == "gptq" else 0)
    device = weight.device
    return (
        _pack_rows(q).to(device),
        _pack_columns(stored, _PLAIN_ORDER).to(device),
        scale.to(device),
        g_idx.to(device),
    )
