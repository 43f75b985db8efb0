"""Skinny GEMM in Triton: y [M, N] = x [M, K] @ W[N, K]^T (+ bias) for the few-row matmuls of decode.

Why: a decode step multiplies every weight matrix by only M = batch rows. For M up to a few dozen the
matmul is a pure weight stream (arithmetic intensity ~M flop/byte, far under the H200's ~200), so
its floor is bytes / bandwidth. cuBLAS picks latency-bound kernels there: on the H200 profile of a
Yuan2-2B decode step at B=1 the 8 MB projections ran at 1.3-1.4 TB/s (6 µs each) and the 32 MB
down projection at 2.3 TB/s with a separate split-K reduce; the GEMMs took 1.56 of 2.15 ms of GPU time.
This kernel streams W once, with enough programs in flight to keep every SM loading.

Shape of the work: program (n_block, k_split) owns BLOCK_N output columns for all M rows (so each
weight byte is read once) over a contiguous 1/SPLIT_K of K. It accumulates fp32 with `tl.dot` on an
[BLOCK_M, BLOCK_K] x [BLOCK_K, BLOCK_N] tile (rows >= M masked to zero). With SPLIT_K == 1 it adds the
bias and writes y directly; otherwise each split writes an fp32 partial [SPLIT_K, M, N] and
`_reduce_kernel` sums the splits in a fixed order (deterministic, unlike atomics), adds the bias and
rounds once.

Numerics: fp32 accumulation of exact bf16/fp16 products, like cuBLAS, in a different order, so
results match `F.linear` to within accumulation rounding (a bf16 ulp on a few elements), not bit for
bit. The reference is `torch.nn.functional.linear` (tests/kernels/test_skinny_gemm.py).

The config (BLOCK_N, BLOCK_K, SPLIT_K, warps, stages) comes from `skinny_config`, a rule fitted to
an H200 sweep (`benchmarks/skinny_gemm_sweep.py`); the launcher never reads device values.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pagoda.kernels.paged_attention import _dot_flags, _mma

DTYPES = (torch.float16, torch.bfloat16)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@dataclass(frozen=True)
class SkinnyConfig:
    block_n: int
    block_k: int
    split_k: int
    num_warps: int = 4
    num_stages: int = 4


@triton.jit
def _skinny_kernel(x_ptr, w_ptr, b_ptr, y_ptr, part_ptr, M, N, K, k_per_split,
                   stride_xm, stride_wn, stride_ym,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, EVEN_K: tl.constexpr,
                   IEEE: tl.constexpr, UPCAST: tl.constexpr):
    """Program (n_block, split): columns [n0, n0 + BLOCK_N) of all M rows over keys
    [split * k_per_split, min(K, (split + 1) * k_per_split)). k_per_split is a multiple of BLOCK_K.
    EVEN_K: every K tile is full (K % BLOCK_K == 0), so the weight loads need no K mask."""
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask_n = offs_n < N
    k_start = split * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :]                 # [BLOCK_M, BLOCK_K]
    w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]    # [BLOCK_N, BLOCK_K]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        if EVEN_K:
            x = tl.load(x_ptrs + k0, mask=mask_m[:, None], other=0.0)
            w = tl.load(w_ptrs + k0, mask=mask_n[:, None], other=0.0, eviction_policy="evict_first")
        else:
            mask_k = (k0 + offs_k) < K
            x = tl.load(x_ptrs + k0, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
            w = tl.load(w_ptrs + k0, mask=mask_n[:, None] & mask_k[None, :], other=0.0,
                        eviction_policy="evict_first")
        acc += _mma(x, tl.trans(w), IEEE, UPCAST)
    out_mask = mask_m[:, None] & mask_n[None, :]
    if SPLIT:
        p_ptrs = part_ptr + (split * M + offs_m[:, None]) * N + offs_n[None, :]
        tl.store(p_ptrs, acc, mask=out_mask)
    else:
        if HAS_BIAS:
            acc += tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        y_ptrs = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :]
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _reduce_kernel(part_ptr, b_ptr, y_ptr, M, N, stride_ym, SPLIT_K: tl.constexpr,
                   HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    """y[m, n] = sum over splits s = 0..SPLIT_K-1 in order of part[s, m, n] (+ bias[n])."""
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < M * N
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for s in tl.static_range(SPLIT_K):
        acc += tl.load(part_ptr + s * M * N + offs, mask=mask, other=0.0)
    n = offs % N
    if HAS_BIAS:
        acc += tl.load(b_ptr + n, mask=mask, other=0.0).to(tl.float32)
    m = offs // N
    tl.store(y_ptr + m * stride_ym + n, acc.to(y_ptr.dtype.element_ty), mask=mask)


def block_m_for(m: int) -> int:
    """Rows per program: all M rows (so W is read once), at least 16 (tl.dot's minimum)."""
    return max(16, triton.next_power_of_2(m))


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def skinny_config(m: int, n: int, k: int, num_sms: int) -> SkinnyConfig:
    """Tile shape and split for a [m, k] x [k, n] weight stream on a GPU with num_sms SMs.

    The rule (fitted to the H200 sweep; see the module docstring): narrow column blocks so there are
    many programs, a wide K tile so each load is long and contiguous, and split K until there are
    about two programs per SM, but keep each split at least two K tiles long."""
    if _interpreting():
        return SkinnyConfig(block_n=16, block_k=32, split_k=2 if k >= 64 else 1, num_warps=1, num_stages=1)
    block_n = 16 if m <= 16 else 32
    block_k = 256 if m <= 32 else 128
    n_blocks = triton.cdiv(n, block_n)
    k_tiles = triton.cdiv(k, block_k)
    split_k = 1
    while n_blocks * split_k < 2 * num_sms and k_tiles // (split_k * 2) >= 2:
        split_k *= 2
    return SkinnyConfig(block_n=block_n, block_k=block_k, split_k=split_k, num_warps=4, num_stages=4)


def supports(x: torch.Tensor, weight: torch.Tensor, max_rows: int) -> bool:
    """Whether `skinny_linear` takes this matmul: CUDA (or the interpreter), fp16/bf16, x rows <= max_rows,
    unit inner strides."""
    if x.dtype not in DTYPES or weight.dtype != x.dtype or weight.dim() != 2:
        return False
    if x.dim() < 1 or x.shape[-1] != weight.shape[1] or x.numel() == 0:
        return False
    rows = x.numel() // x.shape[-1]
    return rows <= max_rows and weight.stride(1) == 1 and (x.is_cuda or _interpreting())


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  config: SkinnyConfig | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) for few rows: x [..., K], weight [N, K], bias [N] → [..., N]."""
    k = x.shape[-1]
    n = weight.shape[0]
    assert weight.shape[1] == k and weight.stride(1) == 1, "weight must be [N, K] with contiguous K"
    x2 = x.reshape(-1, k)
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return y.reshape(*x.shape[:-1], n)
    if config is None:
        sms = _sm_count(x.device.index or 0) if x.is_cuda else 4
        config = skinny_config(m, n, k, sms)
    block_k = config.block_k
    k_per_split = triton.cdiv(triton.cdiv(k, config.split_k), block_k) * block_k
    split_k = triton.cdiv(k, k_per_split)           # rounding may leave fewer non-empty splits
    ieee, upcast = _dot_flags(x.dtype)
    has_bias = bias is not None
    part = torch.empty((split_k, m, n), dtype=torch.float32, device=x.device) if split_k > 1 else y
    _skinny_kernel[(triton.cdiv(n, config.block_n), split_k)](
        x2, weight, bias if has_bias else y, y, part, m, n, k, k_per_split,
        x2.stride(0), weight.stride(0), y.stride(0),
        BLOCK_M=block_m_for(m), BLOCK_N=config.block_n, BLOCK_K=block_k, HAS_BIAS=has_bias,
        SPLIT=split_k > 1, EVEN_K=k % block_k == 0, IEEE=ieee, UPCAST=upcast,
        num_warps=config.num_warps, num_stages=config.num_stages)
    if split_k > 1:
        block = 1024 if not _interpreting() else 64
        _reduce_kernel[(triton.cdiv(m * n, block),)](
            part, bias if has_bias else y, y, m, n, y.stride(0), SPLIT_K=split_k, HAS_BIAS=has_bias,
            BLOCK=block, num_warps=4 if not _interpreting() else 1)
    return y.reshape(*x.shape[:-1], n)
