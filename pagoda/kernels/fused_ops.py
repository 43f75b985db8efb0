"""Fused elementwise kernels for the decoder layers: RMSNorm (alone, or fused with the residual add),
neox-style RoPE for q and k in one launch, SiLU-and-mul, and the LF gate's two-tap state shift.

Each replaces a chain of small PyTorch kernels (a decode step of a 2B model spent ~70 launches per
layer on them) with one launch, and keeps the PyTorch code's numerics: fp32 math inside, rounded to
the activation dtype at the same points. The PyTorch references are the layers' own CPU paths:

| kernel | reference |
| --- | --- |
| `rms_norm` | `pagoda.layers.norm.rms_norm_reference(x, weight, eps)` |
| `fused_add_rms_norm` | `pagoda.layers.norm.rms_norm_reference(x, weight, eps, residual)` |
| `rotary` | `pagoda.layers.rotary.apply_rotary_reference(q, k, (cos, sin))` |
| `silu_and_mul` | `pagoda.layers.activation.silu_and_mul_reference(x)` |
| `two_tap_shift` | `LocalizedFilter`'s PyTorch path: `index_select` + `cat` + `index_copy_` (pure copies) |

Where the results can differ from the reference (everything else is bit-identical):
- RMSNorm's mean of squares is a different fp32 summation order than PyTorch's reduction, and
  1/sqrt is the hardware `rsqrt.approx` on the GPU (as in PyTorch's CUDA rms_norm): the normalized
  value may move by an fp32 ulp, which after rounding to bf16/fp16 flips the last bit of a few
  elements. The residual sum `x + residual` is exact (one fp32 add, rounded to the dtype, as
  PyTorch does), and so is `weight * normed` (a bf16/fp16 product is exact in fp32).
- SiLU uses libdevice's `expf` and a correctly rounded division on the GPU (PyTorch's CUDA silu is
  `x / (1 + expf(-x))` in fp32), so it should agree bit for bit there; under the interpreter `exp`
  is NumPy's (in float64, rounded) and the CPU reference's is Sleef's: they may differ by an fp32
  ulp.
- RoPE: `x1 * cos - x2 * sin` as three rounded fp32 operations, like PyTorch's eager ops — the
  kernels are launched with `enable_fp_fusion=False`, so no multiply-add is contracted into an FMA.

Launchers check shapes/dtypes/strides and launch; they never read device values on the host. Kernels
may not import layers.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_NORM_SIZE = 32768          # one program holds a whole row in registers; wider rows use PyTorch
_ROPE_TILE = 1024             # elements of one RoPE program's [heads, R/2] tile (caps heads per program)
_SILU_BLOCK = 1024            # columns per SiLU-and-mul program


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit
def _round_to(x, ptr, EMULATE_BF16: tl.constexpr):
    """fp32 x rounded to ptr's element type, to nearest even, as the GPU's `cvt.rn` and PyTorch do.

    EMULATE_BF16 (the interpreter only): Triton 3.6's interpreter casts fp32 → bf16 by truncating,
    so round the fp32 bits to nearest even by hand first; the cast that follows is then exact."""
    if EMULATE_BF16:
        if ptr.dtype.element_ty == tl.bfloat16:
            bits = x.to(tl.uint32, bitcast=True)
            bits = bits + 0x7FFF + ((bits >> 16) & 1)
            x = ((bits >> 16) << 16).to(tl.float32, bitcast=True)
    return x.to(ptr.dtype.element_ty)


# ---------------------------------------------------------------------------------------------
# RMSNorm, optionally fused with the residual add
# ---------------------------------------------------------------------------------------------

@triton.jit
def _rms_norm_kernel(x_ptr, residual_ptr, weight_ptr, out_ptr, summed_ptr,
                     stride_x, stride_r, stride_o, stride_s, eps,
                     N_COLS: tl.constexpr, HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
                     EMULATE_BF16: tl.constexpr):
    """One program per row. With a residual: s = round(x + r) is stored and normed; else x is."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < N_COLS
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + offs, mask=mask, other=0.0)
        x = _round_to(x.to(tl.float32) + r.to(tl.float32), x_ptr, EMULATE_BF16)   # rounded like `x + r`
        tl.store(summed_ptr + row * stride_s + offs, x, mask=mask)
    xf = x.to(tl.float32)
    variance = tl.math.div_rn(tl.sum(xf * xf, axis=0), N_COLS * 1.0)   # mean in fp32
    rstd = tl.math.rsqrt(variance + eps)
    normed = _round_to(xf * rstd, x_ptr, EMULATE_BF16)                          # F.rms_norm(...).to(dtype)
    w = tl.load(weight_ptr + offs, mask=mask, other=0.0)
    out = w.to(tl.float32) * normed.to(tl.float32)                               # weight * normed
    tl.store(out_ptr + row * stride_o + offs, _round_to(out, out_ptr, EMULATE_BF16), mask=mask)


def supports_rms_norm(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None = None) -> bool:
    """Cases the kernel covers; the layer uses PyTorch for the rest (mixed dtypes, huge rows)."""
    return (x.dtype in DTYPES and weight.dtype == x.dtype and weight.dim() == 1
            and weight.shape[0] == x.shape[-1] and 0 < x.shape[-1] <= MAX_NORM_SIZE
            and weight.is_contiguous() and weight.device == x.device
            and (residual is None or (residual.shape == x.shape and residual.dtype == x.dtype
                                      and residual.device == x.device)))


def _rows(t: torch.Tensor) -> torch.Tensor:
    """[..., H] as [N, H] with unit stride along H (a view when possible)."""
    t2 = t.reshape(-1, t.shape[-1])
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def _launch_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
                     residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    assert supports_rms_norm(x, weight, residual), "unsupported rms_norm arguments"
    n_cols = x.shape[-1]
    x2 = _rows(x)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    out2 = out.view(-1, n_cols)
    r2 = _rows(residual) if residual is not None else x2
    summed = torch.empty_like(out) if residual is not None else None
    s2 = summed.view(-1, n_cols) if summed is not None else out2
    n_rows = x2.shape[0]
    if n_rows == 0:
        return out, summed
    block = triton.next_power_of_2(n_cols)
    _rms_norm_kernel[(n_rows,)](
        x2, r2, weight, out2, s2, x2.stride(0), r2.stride(0), out2.stride(0), s2.stride(0), float(eps),
        N_COLS=n_cols, HAS_RESIDUAL=residual is not None, BLOCK=block, EMULATE_BF16=_interpreting(),
        num_warps=min(max(block // 512, 1), 16), enable_fp_fusion=False)
    return out, summed


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * F.rms_norm(x.float(), eps).to(x.dtype), over the last dim of x [..., H]."""
    return _launch_rms_norm(x, weight, eps, None)[0]


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(s), s) with s = x + residual rounded to x.dtype: s is the next residual stream."""
    out, summed = _launch_rms_norm(x, weight, eps, residual)
    assert summed is not None
    return out, summed


# ---------------------------------------------------------------------------------------------
# RoPE (neox / rotate-half layout), q and k in one launch
# ---------------------------------------------------------------------------------------------

@triton.jit
def _rope_heads(src, dst, stride_src_h, stride_dst_h, head0, num_heads, cos, sin,
                HALF: tl.constexpr, HEAD_DIM: tl.constexpr,
                BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_PASS: tl.constexpr,
                EMULATE_BF16: tl.constexpr):
    """Rotate heads [head0, head0 + BLOCK_H) of one token: src/dst point at the token's head 0."""
    offs_h = head0 + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_HALF)
    mask_h = offs_h < num_heads
    mask = mask_h[:, None] & (offs_d[None, :] < HALF)
    src_rows = src + offs_h[:, None].to(tl.int64) * stride_src_h
    dst_rows = dst + offs_h[:, None].to(tl.int64) * stride_dst_h
    x1 = tl.load(src_rows + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src_rows + HALF + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
    o1 = x1 * cos[None, :] - x2 * sin[None, :]
    o2 = x2 * cos[None, :] + x1 * sin[None, :]
    tl.store(dst_rows + offs_d[None, :], _round_to(o1, dst, EMULATE_BF16), mask=mask)
    tl.store(dst_rows + HALF + offs_d[None, :], _round_to(o2, dst, EMULATE_BF16), mask=mask)
    if HEAD_DIM > 2 * HALF:                        # partial rotary: the tail passes through
        offs_p = 2 * HALF + tl.arange(0, BLOCK_PASS)
        mask_p = mask_h[:, None] & (offs_p[None, :] < HEAD_DIM)
        tail = tl.load(src_rows + offs_p[None, :], mask=mask_p, other=0.0)
        tl.store(dst_rows + offs_p[None, :], tail, mask=mask_p)          # same dtype: a copy


@triton.jit
def _rope_kernel(q_ptr, k_ptr, q_out_ptr, k_out_ptr, cos_ptr, sin_ptr,
                 stride_qt, stride_qh, stride_kt, stride_kh, stride_qot, stride_qoh, stride_kot, stride_koh,
                 stride_ct, stride_st,
                 NUM_Q_HEADS: tl.constexpr, NUM_K_HEADS: tl.constexpr, Q_BLOCKS: tl.constexpr,
                 HALF: tl.constexpr, HEAD_DIM: tl.constexpr,
                 BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_PASS: tl.constexpr,
                 EMULATE_BF16: tl.constexpr):
    """Grid (T, Q_BLOCKS + K_BLOCKS): program (t, b) rotates a block of BLOCK_H heads of token t,
    of q for b < Q_BLOCKS, else of k."""
    t = tl.program_id(0).to(tl.int64)
    b = tl.program_id(1)
    offs_d = tl.arange(0, BLOCK_HALF)
    mask_d = offs_d < HALF
    cos = tl.load(cos_ptr + t * stride_ct + offs_d, mask=mask_d, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + t * stride_st + offs_d, mask=mask_d, other=0.0).to(tl.float32)
    if b < Q_BLOCKS:
        _rope_heads(q_ptr + t * stride_qt, q_out_ptr + t * stride_qot, stride_qh, stride_qoh,
                    b * BLOCK_H, NUM_Q_HEADS, cos, sin, HALF, HEAD_DIM, BLOCK_H, BLOCK_HALF, BLOCK_PASS,
                    EMULATE_BF16)
    else:
        _rope_heads(k_ptr + t * stride_kt, k_out_ptr + t * stride_kot, stride_kh, stride_koh,
                    (b - Q_BLOCKS) * BLOCK_H, NUM_K_HEADS, cos, sin, HALF, HEAD_DIM, BLOCK_H, BLOCK_HALF,
                    BLOCK_PASS, EMULATE_BF16)


def _table_2d(table: torch.Tensor, t: int) -> torch.Tensor | None:
    """cos or sin [T, 1, R/2] (or [T, R/2]) as [T, R/2] with unit last stride, else None."""
    if table.dim() == 3 and table.shape[1] == 1:
        table = table[:, 0]
    if table.dim() != 2 or table.shape[0] != t or table.stride(-1) != 1:
        return None
    return table


def supports_rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    if q.dim() != 3 or k.dim() != 3 or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]:
        return False
    t, _, head_dim = q.shape
    half = cos.shape[-1]
    return (q.dtype in DTYPES and k.dtype == q.dtype and q.stride(2) == 1 and k.stride(2) == 1
            and cos.dtype in DTYPES and sin.dtype == cos.dtype and sin.shape == cos.shape
            and 0 < 2 * half <= head_dim and q.device == k.device == cos.device == sin.device
            and _table_2d(cos, t) is not None and _table_2d(sin, t) is not None)


def rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
           sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, Hq, D], k [T, Hkv, D] (strided views of a fused projection are fine: only the last dim
    must be contiguous), cos/sin [T, 1, R/2] → new contiguous rotated q, k. The first R dims of each
    head rotate as halves [x1 | x2] → [x1·cos − x2·sin | x2·cos + x1·sin]; dims R..D copy through."""
    assert supports_rotary(q, k, cos, sin), "unsupported rotary arguments"
    t, num_q_heads, head_dim = q.shape
    num_k_heads = k.shape[1]
    half = cos.shape[-1]
    cos2, sin2 = _table_2d(cos, t), _table_2d(sin, t)
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    if t == 0:
        return q_out, k_out
    block_half = triton.next_power_of_2(half)
    block_h = min(triton.next_power_of_2(max(num_q_heads, num_k_heads)), max(1, _ROPE_TILE // block_half))
    q_blocks = triton.cdiv(num_q_heads, block_h)
    k_blocks = triton.cdiv(num_k_heads, block_h)
    _rope_kernel[(t, q_blocks + k_blocks)](
        q, k, q_out, k_out, cos2, sin2,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1),
        cos2.stride(0), sin2.stride(0),
        NUM_Q_HEADS=num_q_heads, NUM_K_HEADS=num_k_heads, Q_BLOCKS=q_blocks, HALF=half, HEAD_DIM=head_dim,
        BLOCK_H=block_h, BLOCK_HALF=block_half,
        BLOCK_PASS=triton.next_power_of_2(max(head_dim - 2 * half, 1)), EMULATE_BF16=_interpreting(),
        num_warps=4, enable_fp_fusion=False)
    return q_out, k_out


# ---------------------------------------------------------------------------------------------
# SiLU-and-mul
# ---------------------------------------------------------------------------------------------

@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, n_cols,
                         BLOCK: tl.constexpr, PRECISE_EXP: tl.constexpr, EMULATE_BF16: tl.constexpr):
    """Grid (T, cdiv(I, BLOCK)): out[t, i] = round(round(silu(x[t, i])) * x[t, I + i])."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_cols
    gate = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + n_cols + offs, mask=mask, other=0.0)
    if PRECISE_EXP:
        e = libdevice.exp(-gate)           # expf, as PyTorch's CUDA silu (tl.exp would be ex2.approx)
    else:
        # The interpreter has no libdevice, and NumPy's float32 exp is a few ulps off; its float64
        # exp rounded to fp32 is (nearly always) the correctly rounded expf, as CUDA's and Sleef's are.
        e = tl.exp(-gate.to(tl.float64)).to(tl.float32)
    silu = _round_to(tl.math.div_rn(gate, 1.0 + e), out_ptr, EMULATE_BF16)   # F.silu(gate), rounded
    out = silu.to(tl.float32) * up.to(tl.float32)                             # * up, rounded again
    tl.store(out_ptr + row * stride_o + offs, _round_to(out, out_ptr, EMULATE_BF16), mask=mask)


def supports_silu_and_mul(x: torch.Tensor) -> bool:
    return x.dtype in DTYPES and x.dim() >= 1 and x.shape[-1] % 2 == 0 and x.shape[-1] > 0


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [..., 2I] laid out [gate | up] → F.silu(gate) * up [..., I], in x.dtype."""
    assert supports_silu_and_mul(x), "unsupported silu_and_mul arguments"
    n_cols = x.shape[-1] // 2
    x2 = _rows(x)
    out = torch.empty((*x.shape[:-1], n_cols), dtype=x.dtype, device=x.device)
    out2 = out.view(-1, n_cols)
    if x2.shape[0] == 0:
        return out
    block = min(triton.next_power_of_2(n_cols), _SILU_BLOCK)
    _silu_and_mul_kernel[(x2.shape[0], triton.cdiv(n_cols, block))](
        x2, out2, x2.stride(0), out2.stride(0), n_cols,
        BLOCK=block, PRECISE_EXP=not _interpreting(), EMULATE_BF16=_interpreting(), num_warps=4, enable_fp_fusion=False)
    return out


# ---------------------------------------------------------------------------------------------
# Two-tap state shift (Yuan2's LF gate on one-token rows)
# ---------------------------------------------------------------------------------------------

@triton.jit
def _two_tap_shift_kernel(cur_ptr, state_ptr, slots_ptr, snap_ptr, snapshots_ptr, out_ptr,
                          stride_cur, stride_state, stride_snap, stride_out, col0,
                          N_COLS: tl.constexpr, BLOCK: tl.constexpr, HAS_SNAPSHOT: tl.constexpr):
    """Grid (B, cdiv(F, BLOCK)). Row b: out[b] = [state[slot, col0:col0+F] | cur[b]], then
    state[slot, col0:col0+F] = cur[b] (and snapshots[snap[b], same columns] = cur[b])."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N_COLS
    slot = tl.load(slots_ptr + row).to(tl.int64)
    saved = state_ptr + slot * stride_state + col0 + offs
    previous = tl.load(saved, mask=mask, other=0.0)
    current = tl.load(cur_ptr + row * stride_cur + offs, mask=mask, other=0.0)
    tl.store(out_ptr + row * stride_out + offs, previous, mask=mask)
    tl.store(out_ptr + row * stride_out + N_COLS + offs, current, mask=mask)
    tl.debug_barrier()                 # every lane has read the old state before any lane overwrites it
    tl.store(saved, current, mask=mask)
    if HAS_SNAPSHOT:
        snap = tl.load(snap_ptr + row).to(tl.int64)
        tl.store(snapshots_ptr + snap * stride_snap + col0 + offs, current, mask=mask)


def supports_two_tap_shift(current: torch.Tensor, state: torch.Tensor, col0: int) -> bool:
    return (current.dim() == 2 and state.dim() == 2 and current.dtype in DTYPES and state.dtype == current.dtype
            and current.stride(1) == 1 and state.stride(1) == 1 and current.device == state.device
            and 0 <= col0 and col0 + current.shape[1] <= state.shape[1])


def two_tap_shift(current: torch.Tensor, state: torch.Tensor, col0: int, slots: torch.Tensor,
                  snapshot_index: torch.Tensor | None = None,
                  snapshots: torch.Tensor | None = None) -> torch.Tensor:
    """One launch for a width-2 causal convolution's input on one-token rows, plus the state update.

    current [B, F] (row b is the one new token of the sequence in state slot slots[b]); state
    [S, W], whose columns [col0, col0 + F) hold each sequence's previous token. Returns [B, 2F] =
    [previous | current] (what `torch.cat([state[slots, cols], current], -1)` gives) and writes
    state[slots[b], cols] = current[b]; with snapshots, also snapshots[snapshot_index[b], cols].
    Slots must be distinct except for rows whose outputs are discarded (CUDA-graph padding rows
    sharing one scratch slot, which read whatever the others left)."""
    assert supports_two_tap_shift(current, state, col0), "unsupported two_tap_shift arguments"
    rows, n_cols = current.shape
    out = torch.empty(rows, 2 * n_cols, dtype=current.dtype, device=current.device)
    if rows == 0:
        return out
    has_snapshot = snapshot_index is not None
    if has_snapshot:
        assert snapshots is not None and snapshots.stride(1) == 1 and snapshots.shape[1] == state.shape[1]
    block = min(triton.next_power_of_2(n_cols), 1024)
    _two_tap_shift_kernel[(rows, triton.cdiv(n_cols, block))](
        current, state, slots, snapshot_index if has_snapshot else slots, snapshots if has_snapshot else state,
        out, current.stride(0), state.stride(0), snapshots.stride(0) if has_snapshot else 0, out.stride(0), col0,
        N_COLS=n_cols, BLOCK=block, HAS_SNAPSHOT=has_snapshot, num_warps=4)
    return out
