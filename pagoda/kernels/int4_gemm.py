"""4-bit weight matmuls (AWQ, GPTQ) in Triton: y [M, N] = x [M, K] · Wᵀ (+ bias), W dequantized on the fly.

Why: a 4-bit weight is a quarter of a bf16 weight's bytes, and decode steps stream every weight once
per step, so a matmul that reads the packed weights and dequantizes them in registers moves a
quarter of the bytes of `F.linear` on the dequantized weight (which would also need the bf16 copy
in memory).

The weights are in Pagoda's layout (`pagoda/layers/quantization/int4_formats.py`): qweight int32
[K/8, N] packed along K (nibble j of qweight[r, n] is q[8r + j, n]), scales and integer zero points
[G, N] (any float dtype), g_idx int32 [K]; W[n, k] = (q[k, n] − zeros[g, n]) · scales[g, n] with
g = g_idx[k]. With `group_size` given, the rows are in order (g = k // group_size), and the kernels
compute g instead of loading g_idx.

Two kernels:
- M ≤ `policy.INT4_GEMV_MAX_ROWS`: a GEMV. Program (p, s) owns BLOCK_N output columns for all M rows and split s of K
  (each weight byte is read once). Per K tile it loads [BLOCK_K/8, BLOCK_N] packed words, and for each
  nibble position j the [BLOCK_K/8] elements of x at rows 8r + j (L2-resident, re-read by every
  program), multiplies on the CUDA cores into one elementwise fp32 accumulator per row of x (the rows
  unrolled, up to GEMV_ROWS), and reduces along K once at the end. At few rows a matmul is a weight
  stream; tensor cores would not help.
- Larger M: a GEMM over [BLOCK_M, BLOCK_N] output tiles: each [BLOCK_K/8, BLOCK_N] word tile is
  expanded to [BLOCK_K, BLOCK_N], dequantized to x's dtype, and multiplied with `tl.dot`. Programs
  run M tiles fastest, so the programs sharing a weight tile run together and read it from HBM once.
With few programs for the GPU (few columns, long K) both split K over a second grid axis: each split
writes an fp32 partial and a small kernel sums them, adds the bias and rounds (one extra launch).

Dequantizing: q | 0x4B000000 read as an fp32 is 2^23 + q exactly, so q − z is one fp32 subtraction
of 2^23 + z, with no integer-to-float conversion. When a K tile lies inside one group (group_size
given and a multiple of BLOCK_K, or one group over all of K) the scale is applied after the products:
x·(q − z) summed over the tile's 8 nibble positions (GEMV) or over the tile (GEMM, where q − z is
exact in x's dtype), then times the scale. Otherwise (act order, or a group size the tile does not
divide) each weight gets its own group's scale: the GEMV keeps (q − z)·s in fp32, the GEMM rounds it
to x's dtype for the tensor cores, as `int4_matmul_reference` rounds W.

Numerics: q − z, and for bf16/fp16 scales (q − z)·s, are exact in fp32; a product with x is exact or
rounded once (2^-24 relative); the sums are fp32 (split partials and the bias too), rounded once to
x's dtype. So results are within fp32 rounding of the exact result of the quantized weights, plus, for
the act-order GEMM only, each weight's rounding to x's dtype. The reference is `int4_matmul_reference`
in float64 (tests/kernels/test_int4_gemm.py). fp32 x uses IEEE fp32 dots (no TF32). The interpreter's
`tl.dot` reads bf16 bits as integers, so under it the dot operands are fp32.

The launcher checks shapes, dtypes and strides, never reads device values, and takes its config from
`int4_config`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pagoda.kernels import pdl, policy
from pagoda.kernels.pdl import wait_for_inputs
from pagoda.kernels.triton_utils import DTYPES, interpreting, round_to

PACK = 8  # 4-bit values per int32
# Rows up to this go to the GEMV, above it to the tensor-core GEMM. At M rows the GEMV spends about
# four integer/fp32 operations per weight unpacking it plus M FMAs, the GEMM the unpacking plus the
# dot; `benchmarks/kernels/int4_gemm_bench.py` times both kernels at every M to place the switch.
GEMV_ROWS = 4  # the most rows the GEMV kernel holds (one accumulator each, unrolled)
_MAGIC_BITS = tl.constexpr(0x4B000000)  # the fp32 2^23: OR-ing an integer below 2^23 into its mantissa adds it
_MAGIC = tl.constexpr(8388608.0)  # 2^23
_GROUP_IN_TILE, _GROUP_PER_ROW, _GROUP_FROM_INDEX = 0, 1, 2
_DEFAULT_SMS = 132  # an H200's; the launcher passes the device's own count


@dataclass(frozen=True)
class Int4Config:
    gemv: bool  # the CUDA-core GEMV (block_m unused) or the tl.dot GEMM
    block_m: int
    block_n: int
    block_k: int  # a multiple of 8 (of 16 for the GEMM)
    split_k: int  # K split over this many programs per output tile (1: no partials)
    num_warps: int
    num_stages: int


def _fit_block_k(block_k: int, group_size: int | None, k: int, smallest: int) -> int:
    """block_k halved until it divides the group size (a tile then lies inside one group), while
    it stays at least `smallest`; unchanged when no halving gets there."""
    if group_size is None or group_size <= 0 or group_size >= k:
        return block_k
    fitted = block_k
    while fitted > smallest and group_size % fitted:
        fitted //= 2
    return fitted if group_size % fitted == 0 else block_k


def int4_config(
    m: int,
    n: int,
    k: int,
    *,
    group_size: int | None = None,
    dtype: torch.dtype = torch.bfloat16,
    sms: int = _DEFAULT_SMS,
) -> Int4Config:
    """The kernel and tiles for an [m, k] x [k, n] matmul. The GEMV: 32 columns per program (a 128-byte
    line of each packed row), K tiles of up to 256 rows; the GEMM: 16-row tiles up to M = 16, larger
    above, and small tiles for fp32 (its IEEE dot runs on the CUDA cores and spills registers at the
    bf16 tiles). K tiles are fitted inside a group where the group size allows; K is split until there
    are about two programs per SM, as far as the partials' traffic allows. Under the interpreter: tiny
    tiles and no split."""
    gemv = m <= min(policy.INT4_GEMV_MAX_ROWS, GEMV_ROWS)
    if interpreting():
        if gemv:
            return Int4Config(True, 1, 32, _fit_block_k(64, group_size, k, 8), 1, 1, 1)
        return Int4Config(False, 16, 32, _fit_block_k(64, group_size, k, 16), 1, 1, 1)
    if gemv:
        block_m, block_n, block_k, warps = 1, 32, _fit_block_k(256, group_size, k, 8), 4
        tiles = triton.cdiv(n, block_n)
    else:
        if dtype == torch.float32:
            block_m, block_n, block_k = (16 if m <= 16 else 32), 32, 32
        else:
            block_m = 16 if m <= 16 else 32 if m <= 32 else 64 if m <= 256 else 128
            block_n, block_k = (64, 128) if m <= 64 else (128, 64)
        block_k = _fit_block_k(block_k, group_size, k, 16)
        warps = 4 if block_m * block_n <= 64 * 64 else 8
        tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    k_tiles = triton.cdiv(k, block_k)
    # the partials' fp32 traffic (8·S·M·N bytes written and read) stays below the weight's (N·K/2)
    split = min(k_tiles, max(1, triton.cdiv(2 * sms, tiles)), max(1, k // (16 * m)))
    split = triton.cdiv(k_tiles, triton.cdiv(k_tiles, split))  # every split gets whole tiles, none empty
    return Int4Config(gemv, block_m, block_n, block_k, split, warps, 3)


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


# ---------------------------------------------------------------------------------------------
# Device helpers
# ---------------------------------------------------------------------------------------------


@triton.jit
def _minus_zero(words, shift, zero_magic):
    """q − z in fp32 for the nibble at `shift` of each word; zero_magic = 2^23 + z (exact)."""
    bits = ((words >> shift) & 0xF) | _MAGIC_BITS
    return bits.to(tl.float32, bitcast=True) - zero_magic


@triton.jit
def _load_words(q_ptr, packed_rows, offs_n, stride_qk, K, N, EVEN: tl.constexpr):
    """The [BLOCK_K/8, BLOCK_N] packed words at packed_rows × offs_n; EVEN: no mask needed."""
    ptrs = q_ptr + packed_rows[:, None] * stride_qk + offs_n[None, :]
    if EVEN:
        return tl.load(ptrs, eviction_policy="evict_first")
    mask = (packed_rows < K // 8)[:, None] & (offs_n < N)[None, :]
    return tl.load(ptrs, mask=mask, other=0, eviction_policy="evict_first")


@triton.jit
def _group_vector(ptr, g, stride_g, offs_n, N):
    """Row g of a [G, N] scales/zeros tensor at offs_n, as fp32 [BLOCK_N]."""
    return tl.load(ptr + g * stride_g + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)


@triton.jit
def _row_groups(g_ptr, k, K, GROUP, GROUP_MODE: tl.constexpr):
    """The group of each input row k: k // GROUP, or g_idx[k]."""
    if GROUP_MODE == 1:
        g = k // GROUP
    else:
        g = tl.load(g_ptr + k, mask=k < K, other=0)
    return g


@triton.jit
def _group_tile(ptr, g, stride_g, offs_n, N):
    """[len(g), BLOCK_N] of a [G, N] scales/zeros tensor: row g[i] for each i, as fp32."""
    return tl.load(ptr + g[:, None] * stride_g + offs_n[None, :], mask=(offs_n < N)[None, :], other=0.0).to(tl.float32)


@triton.jit
def _row_multiply_add(acc, x_ptr, row, M, stride_xm, k, K, w, PRESENT: tl.constexpr):
    """acc + x[row, k]·w elementwise ([BLOCK_K/8, BLOCK_N]; k: one input row per packed row) when the
    kernel has this row (PRESENT); rows ≥ M read zeros."""
    if PRESENT:
        xk = tl.load(x_ptr + row * stride_xm + k, mask=(k < K) & (row < M), other=0.0).to(tl.float32)
        acc += xk[:, None] * w
    return acc


@triton.jit
def _scaled_add(acc, part, scale, PRESENT: tl.constexpr):
    if PRESENT:
        acc += part * scale[None, :]
    return acc


@triton.jit
def _store_row(
    acc,
    row,
    offs_n,
    M,
    N,
    b_ptr,
    y_ptr,
    stride_ym,
    split_offset,
    HAS_BIAS: tl.constexpr,
    SPLIT: tl.constexpr,
    EMULATE_BF16: tl.constexpr,
    PRESENT: tl.constexpr,
):
    """One row of the GEMV: acc [BLOCK_K/8, BLOCK_N] summed over K, stored by `_store_result`."""
    if PRESENT:
        _store_result(
            tl.sum(acc, axis=0)[None, :],
            row + tl.arange(0, 1),
            offs_n,
            M,
            N,
            b_ptr,
            y_ptr,
            stride_ym,
            split_offset,
            HAS_BIAS,
            SPLIT,
            EMULATE_BF16,
        )


@triton.jit
def _store_result(
    acc,
    offs_m,
    offs_n,
    M,
    N,
    b_ptr,
    y_ptr,
    stride_ym,
    split_offset,
    HAS_BIAS: tl.constexpr,
    SPLIT: tl.constexpr,
    EMULATE_BF16: tl.constexpr,
):
    """acc [rows, BLOCK_N] fp32 → y; SPLIT: into the fp32 workspace at split_offset, no bias."""
    mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    offsets = offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :]
    if SPLIT:
        tl.store(y_ptr + split_offset + offsets, acc, mask=mask)
    else:
        if HAS_BIAS:
            acc += tl.load(b_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
        tl.store(y_ptr + offsets, round_to(acc, y_ptr, EMULATE_BF16), mask=mask)


# ---------------------------------------------------------------------------------------------
# Kernels
# ---------------------------------------------------------------------------------------------


@triton.jit
def _int4_gemv_kernel(
    x_ptr,
    q_ptr,
    s_ptr,
    z_ptr,
    g_ptr,
    b_ptr,
    y_ptr,
    M,
    N,
    K,
    GROUP,
    K_SPLIT,
    stride_xm,
    stride_qk,
    stride_sg,
    stride_zg,
    stride_ym,
    stride_split,
    ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_MODE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SPLIT: tl.constexpr,
    EVEN: tl.constexpr,
    EMULATE_BF16: tl.constexpr,
    PDL: tl.constexpr,
):
    """Program (p, s): columns [p·BLOCK_N, (p+1)·BLOCK_N) of rows 0..M-1 (M = ROWS ≤ GEMV_ROWS),
    input rows [s·K_SPLIT, (s+1)·K_SPLIT). GROUP_MODE 0: each K tile inside group k0 // GROUP; 1: row
    k in group k // GROUP; 2: in group g_idx[k]. EVEN: K % BLOCK_K == 0 and N % BLOCK_N == 0.

    Each row of x has its own [BLOCK_K/8, BLOCK_N] accumulator in the packed words' own layout (a
    3-D [rows, K, N] accumulator gets a layout of its own, and every tile is converted to it through
    shared memory); the rows are unrolled up to GEMV_ROWS."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    wait_for_inputs(PDL)
    BLOCK_R: tl.constexpr = BLOCK_K // 8  # packed rows per tile
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_r = tl.arange(0, BLOCK_R)
    acc0 = tl.zeros([BLOCK_R, BLOCK_N], dtype=tl.float32)
    acc1 = tl.zeros([BLOCK_R, BLOCK_N], dtype=tl.float32)
    acc2 = tl.zeros([BLOCK_R, BLOCK_N], dtype=tl.float32)
    acc3 = tl.zeros([BLOCK_R, BLOCK_N], dtype=tl.float32)
    k_begin = pid_k * K_SPLIT
    k_end = tl.minimum(k_begin + K_SPLIT, K)
    for k0 in range(k_begin, k_end, BLOCK_K):
        words = _load_words(q_ptr, k0 // 8 + offs_r, offs_n, stride_qk, K, N, EVEN)
        first_rows = k0 + 8 * offs_r  # input row of nibble 0 of each packed row
        if GROUP_MODE == 0:
            scale = _group_vector(s_ptr, k0 // GROUP, stride_sg, offs_n, N)
            zero = _group_vector(z_ptr, k0 // GROUP, stride_zg, offs_n, N)[None, :] + _MAGIC
            part0 = tl.zeros([BLOCK_R, BLOCK_N], dtype=tl.float32)
            part1 = tl.zeros([BLOCK_R, BLOCK_N], dtype=tl.float32)
            part2 = tl.zeros([BLOCK_R, BLOCK_N], dtype=tl.float32)
            part3 = tl.zeros([BLOCK_R, BLOCK_N], dtype=tl.float32)
            for j in tl.static_range(8):
                k = first_rows + j
                w = _minus_zero(words, 4 * j, zero)
                part0 = _row_multiply_add(part0, x_ptr, 0, M, stride_xm, k, K, w, True)
                part1 = _row_multiply_add(part1, x_ptr, 1, M, stride_xm, k, K, w, ROWS > 1)
                part2 = _row_multiply_add(part2, x_ptr, 2, M, stride_xm, k, K, w, ROWS > 2)
                part3 = _row_multiply_add(part3, x_ptr, 3, M, stride_xm, k, K, w, ROWS > 3)
            # one group per tile: its scale once per packed row and column
            acc0 = _scaled_add(acc0, part0, scale, True)
            acc1 = _scaled_add(acc1, part1, scale, ROWS > 1)
            acc2 = _scaled_add(acc2, part2, scale, ROWS > 2)
            acc3 = _scaled_add(acc3, part3, scale, ROWS > 3)
        else:
            for j in tl.static_range(8):
                k = first_rows + j
                g = _row_groups(g_ptr, k, K, GROUP, GROUP_MODE)
                zero = _group_tile(z_ptr, g, stride_zg, offs_n, N) + _MAGIC
                w = _minus_zero(words, 4 * j, zero) * _group_tile(s_ptr, g, stride_sg, offs_n, N)
                acc0 = _row_multiply_add(acc0, x_ptr, 0, M, stride_xm, k, K, w, True)
                acc1 = _row_multiply_add(acc1, x_ptr, 1, M, stride_xm, k, K, w, ROWS > 1)
                acc2 = _row_multiply_add(acc2, x_ptr, 2, M, stride_xm, k, K, w, ROWS > 2)
                acc3 = _row_multiply_add(acc3, x_ptr, 3, M, stride_xm, k, K, w, ROWS > 3)
    split_offset = pid_k.to(tl.int64) * stride_split
    _store_row(acc0, 0, offs_n, M, N, b_ptr, y_ptr, stride_ym, split_offset, HAS_BIAS, SPLIT, EMULATE_BF16, True)
    _store_row(acc1, 1, offs_n, M, N, b_ptr, y_ptr, stride_ym, split_offset, HAS_BIAS, SPLIT, EMULATE_BF16, ROWS > 1)
    _store_row(acc2, 2, offs_n, M, N, b_ptr, y_ptr, stride_ym, split_offset, HAS_BIAS, SPLIT, EMULATE_BF16, ROWS > 2)
    _store_row(acc3, 3, offs_n, M, N, b_ptr, y_ptr, stride_ym, split_offset, HAS_BIAS, SPLIT, EMULATE_BF16, ROWS > 3)


@triton.jit
def _dot(x, w, DOT_FP32: tl.constexpr):
    """x [BLOCK_M, BLOCK_K] · w [BLOCK_K, BLOCK_N] (w already exact in x's dtype) → fp32. DOT_FP32: IEEE
    fp32 (fp32 x, and every dtype under the interpreter)."""
    if DOT_FP32:
        product = tl.dot(x.to(tl.float32), w.to(tl.float32), input_precision="ieee")
    else:
        product = tl.dot(x, w.to(x.dtype))
    return product


@triton.jit
def _int4_gemm_kernel(
    x_ptr,
    q_ptr,
    s_ptr,
    z_ptr,
    g_ptr,
    b_ptr,
    y_ptr,
    M,
    N,
    K,
    GROUP,
    K_SPLIT,
    stride_xm,
    stride_qk,
    stride_sg,
    stride_zg,
    stride_ym,
    stride_split,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_MODE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SPLIT: tl.constexpr,
    EVEN: tl.constexpr,
    DOT_FP32: tl.constexpr,
    EMULATE_BF16: tl.constexpr,
    PDL: tl.constexpr,
):
    """Program (i, p, s): rows [i·BLOCK_M, (i+1)·BLOCK_M) × columns [p·BLOCK_N, (p+1)·BLOCK_N), input
    rows [s·K_SPLIT, (s+1)·K_SPLIT). GROUP_MODE and EVEN as in the GEMV; DOT_FP32 as in `_dot`."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    wait_for_inputs(PDL)
    BLOCK_R: tl.constexpr = BLOCK_K // 8
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    offs_r = tl.arange(0, BLOCK_R)
    shifts = 4 * tl.arange(0, 8)
    mask_m = offs_m < M
    x_rows = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    k_begin = pid_k * K_SPLIT
    k_end = tl.minimum(k_begin + K_SPLIT, K)
    for k0 in range(k_begin, k_end, BLOCK_K):
        k = k0 + offs_k
        x = tl.load(x_rows + k[None, :], mask=mask_m[:, None] & (k < K)[None, :], other=0.0)
        words = _load_words(q_ptr, k0 // 8 + offs_r, offs_n, stride_qk, K, N, EVEN)
        nibbles = (words[:, None, :] >> shifts[None, :, None]) & 0xF  # [BLOCK_R, 8, BLOCK_N]
        q_magic = (tl.reshape(nibbles, (BLOCK_K, BLOCK_N)) | _MAGIC_BITS).to(tl.float32, bitcast=True)  # row 8r + j
        if GROUP_MODE == 0:
            zero = _group_vector(z_ptr, k0 // GROUP, stride_zg, offs_n, N) + _MAGIC
            scale = _group_vector(s_ptr, k0 // GROUP, stride_sg, offs_n, N)
            acc += _dot(x, q_magic - zero[None, :], DOT_FP32) * scale[None, :]  # q − z: exact in any dtype
        else:
            g = _row_groups(g_ptr, k, K, GROUP, GROUP_MODE)
            w = (q_magic - (_group_tile(z_ptr, g, stride_zg, offs_n, N) + _MAGIC)) * _group_tile(
                s_ptr, g, stride_sg, offs_n, N
            )
            acc += _dot(x, round_to(w, x_ptr, EMULATE_BF16), DOT_FP32)
    _store_result(
        acc,
        offs_m,
        offs_n,
        M,
        N,
        b_ptr,
        y_ptr,
        stride_ym,
        pid_k.to(tl.int64) * stride_split,
        HAS_BIAS,
        SPLIT,
        EMULATE_BF16,
    )


@triton.jit
def _split_k_sum_kernel(
    ws_ptr,
    b_ptr,
    y_ptr,
    M,
    N,
    SPLIT_K,
    BLOCK_N: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    EMULATE_BF16: tl.constexpr,
    PDL: tl.constexpr,
):
    """y[m, n] = Σ_s ws[s, m, n] (+ bias[n]) in fp32, rounded once; program (p, m): one row's columns
    [p·BLOCK_N, (p+1)·BLOCK_N). ws [SPLIT_K, M, N] and y [M, N] contiguous."""
    pid_n = tl.program_id(0)
    row = tl.program_id(1).to(tl.int64)
    wait_for_inputs(PDL)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = offs_n < N
    offsets = row * N + offs_n
    acc = tl.load(ws_ptr + offsets, mask=mask, other=0.0)
    for s in range(1, SPLIT_K):
        acc += tl.load(ws_ptr + s * M * N + offsets, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + offsets, round_to(acc, y_ptr, EMULATE_BF16), mask=mask)


# ---------------------------------------------------------------------------------------------
# Launchers
# ---------------------------------------------------------------------------------------------


def supports(x: torch.Tensor, qweight: torch.Tensor) -> bool:
    """Whether `int4_matmul` takes x [M, K] (fp16/bf16/fp32, unit column stride) with qweight int32
    [K/8, N] (unit column stride) on the same CUDA device (or under the interpreter)."""
    if x.dim() != 2 or x.dtype not in DTYPES or x.stride(1) != 1:
        return False
    if qweight.dim() != 2 or qweight.dtype != torch.int32 or qweight.stride(1) != 1:
        return False
    return x.shape[1] == PACK * qweight.shape[0] and x.device == qweight.device and (x.is_cuda or interpreting())


def _check_groups_tensor(t: torch.Tensor, name: str, n: int) -> None:
    if t.dim() != 2 or t.shape[1] != n or t.stride(1) != 1 or not t.is_floating_point():
        raise ValueError(f"{name} must be a float [groups, {n}] tensor with unit column stride, got {tuple(t.shape)}")


def int4_matmul(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    g_idx: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    group_size: int | None = None,
    config: Int4Config | None = None,
) -> torch.Tensor:
    """x [M, K] · Wᵀ (+ bias [N]) → y [M, N] in x's dtype, W in Pagoda's int4 layout.

    group_size: the rows are in order, row k in group k // group_size (≤ 0: one group over all of
    K), and g_idx is not read; None: row k in group g_idx[k] (act order)."""
    if x.dim() != 2 or x.stride(1) != 1 or x.dtype not in DTYPES:
        raise ValueError(f"x must be a 2-D fp16/bf16/fp32 tensor with unit column stride, got {tuple(x.shape)}")
    m, k = x.shape
    if qweight.dim() != 2 or qweight.dtype != torch.int32 or qweight.stride(1) != 1 or PACK * qweight.shape[0] != k:
        raise ValueError(f"qweight must be int32 [{k // PACK}, N] with unit column stride, got {tuple(qweight.shape)}")
    n = qweight.shape[1]
    _check_groups_tensor(scales, "scales", n)
    _check_groups_tensor(zeros, "zeros", n)
    if scales.shape[0] != zeros.shape[0]:
        raise ValueError(f"scales and zeros disagree: {tuple(scales.shape)} and {tuple(zeros.shape)}")
    if bias is not None and (bias.shape != (n,) or bias.stride(0) != 1 or not bias.is_floating_point()):
        raise ValueError(f"bias must be a contiguous float [{n}] vector")
    group = k if group_size is None or group_size <= 0 or group_size >= k else group_size
    if group_size is None:
        if g_idx.shape != (k,) or g_idx.dtype != torch.int32 or g_idx.stride(0) != 1:
            raise ValueError(f"g_idx must be a contiguous int32 [{k}] vector, got {tuple(g_idx.shape)}")
    elif scales.shape[0] < triton.cdiv(k, group):
        raise ValueError(f"{scales.shape[0]} groups cannot cover {k} input rows in groups of {group}")
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    if config is None:
        sms = _DEFAULT_SMS
        if x.is_cuda:
            sms = _sm_count(x.device.index if x.device.index is not None else torch.cuda.current_device())
        config = int4_config(m, n, k, group_size=group_size, dtype=x.dtype, sms=sms)
    if config.block_k % (PACK if config.gemv else 16):
        raise ValueError(f"block_k {config.block_k} must be a multiple of {PACK if config.gemv else 16}")
    if group_size is None:
        mode = _GROUP_FROM_INDEX
    elif group % config.block_k == 0 or group >= k:
        mode = _GROUP_IN_TILE
    else:
        mode = _GROUP_PER_ROW
    k_split = triton.cdiv(triton.cdiv(k, config.block_k), config.split_k) * config.block_k
    splits = triton.cdiv(k, k_split)
    out = y if splits == 1 else torch.empty((splits, m, n), dtype=torch.float32, device=x.device)
    emulate_bf16 = interpreting() and x.dtype == torch.bfloat16
    launch = pdl.launch_args(x)
    args = (
        x,
        qweight,
        scales,
        zeros,
        g_idx,
        bias if bias is not None else y,
        out,
        m,
        n,
        k,
        group,
        k_split,
        x.stride(0),
        qweight.stride(0),
        scales.stride(0),
        zeros.stride(0),
        n,
        m * n,
    )
    common = {
        "BLOCK_N": config.block_n,
        "BLOCK_K": config.block_k,
        "GROUP_MODE": mode,
        "HAS_BIAS": bias is not None,
        "SPLIT": splits > 1,
        "EVEN": k % config.block_k == 0 and n % config.block_n == 0,
        "EMULATE_BF16": emulate_bf16,
        "num_warps": config.num_warps,
        "num_stages": config.num_stages,
        **launch,
    }
    if config.gemv:
        if m > GEMV_ROWS:
            raise ValueError(f"the GEMV takes at most {GEMV_ROWS} rows, got {m}")
        _int4_gemv_kernel[(triton.cdiv(n, config.block_n), splits)](*args, ROWS=m, **common)
    else:
        grid = (triton.cdiv(m, config.block_m), triton.cdiv(n, config.block_n), splits)
        _int4_gemm_kernel[grid](
            *args, BLOCK_M=config.block_m, DOT_FP32=interpreting() or x.dtype == torch.float32, **common
        )
    if splits > 1:
        block = min(triton.next_power_of_2(n), 1024)
        _split_k_sum_kernel[(triton.cdiv(n, block), m)](
            out,
            bias if bias is not None else y,
            y,
            m,
            n,
            splits,
            BLOCK_N=block,
            HAS_BIAS=bias is not None,
            EMULATE_BF16=emulate_bf16,
            num_warps=4,
            **launch,
        )
    return y
