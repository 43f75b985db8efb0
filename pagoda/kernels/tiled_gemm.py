"""Tiled GEMM in Triton for the mid-size decode matmuls: y [M, N] = x [M, K] @ W[N, K]^T (+ bias).

Why: at decode batch 128-512 a 2048 x 2048 projection is neither a pure weight stream nor a big
GEMM. On the H200 profile of a Yuan2-2B step at B=256, cuBLAS ran those matmuls with 64 x 64 tiles
at ~11.7 µs each (~180 TFLOP/s; the floor is ~3 µs): 128 programs that each stream a 64-row slab
of x and of W over all of K, so the operands cross L2 many times. Larger tiles with a K split give
as many programs with a quarter of the L2 traffic.

Shape of the work: program (tile, split) owns a BLOCK_M x BLOCK_N output tile over a contiguous
1/SPLIT_K of K. Tiles are numbered m-fastest, so the programs that share a W column block run
together and W is read from HBM once. With SPLIT_K == 1 the program adds the bias and writes y;
otherwise it writes an fp32 partial [SPLIT_K, M, N] and `_split_reduce_kernel` sums the splits in a
fixed order (deterministic, unlike atomics), adds the bias and rounds once.

Numerics: fp32 accumulation of exact bf16/fp16 products, like cuBLAS, in a different order: results
match `F.linear` to within accumulation rounding, not bit for bit (tests/kernels/test_tiled_gemm.py).
"""

from __future__ import annotations

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
class GemmConfig:
    block_m: int
    block_n: int
    block_k: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3

    def label(self) -> str:
        return (f"m{self.block_m} n{self.block_n} k{self.block_k} s{self.split_k} "
                f"w{self.num_warps} st{self.num_stages}")


@triton.jit
def _gemm_kernel(x_ptr, w_ptr, b_ptr, y_ptr, part_ptr, M, N, K, k_per_split,
                 stride_xm, stride_wn, stride_ym,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, EVEN_K: tl.constexpr,
                 IEEE: tl.constexpr, UPCAST: tl.constexpr):
    """Program (tile, split): output tile (tile % m_tiles, tile // m_tiles) over keys
    [split * k_per_split, min(K, (split + 1) * k_per_split)); k_per_split is a multiple of BLOCK_K.
    EVEN_K: every K tile is full, so the loads need no K mask."""
    tile = tl.program_id(0)
    split = tl.program_id(1)
    m_tiles = tl.cdiv(M, BLOCK_M)
    pid_m = tile % m_tiles
    pid_n = tile // m_tiles
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask_n = offs_n < N
    k_start = split * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    x_ptrs = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :]     # [BLOCK_M, BLOCK_K]
    w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]     # [BLOCK_N, BLOCK_K]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        if EVEN_K:
            x = tl.load(x_ptrs + k0, mask=mask_m[:, None], other=0.0)
            w = tl.load(w_ptrs + k0, mask=mask_n[:, None], other=0.0)
        else:
            mask_k = (k0 + offs_k) < K
            x = tl.load(x_ptrs + k0, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
            w = tl.load(w_ptrs + k0, mask=mask_n[:, None] & mask_k[None, :], other=0.0)
        acc += _mma(x, tl.trans(w), IEEE, UPCAST)
    out_mask = mask_m[:, None] & mask_n[None, :]
    if SPLIT:
        p_ptrs = part_ptr + (split * M + offs_m[:, None]).to(tl.int64) * N + offs_n[None, :]
        tl.store(p_ptrs, acc, mask=out_mask)
    else:
        if HAS_BIAS:
            acc += tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        y_ptrs = y_ptr + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :]
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _split_reduce_kernel(part_ptr, b_ptr, y_ptr, M, N, stride_ym, SPLIT_K: tl.constexpr,
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


def supports(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `tiled_linear` takes this matmul: CUDA (or the interpreter), fp16/bf16 operands of one
    dtype, unit inner strides."""
    if x.dtype not in DTYPES or weight.dtype != x.dtype or weight.dim() != 2:
        return False
    if x.dim() < 1 or x.shape[-1] != weight.shape[1] or x.numel() == 0:
        return False
    return weight.stride(1) == 1 and x.stride(-1) == 1 and (x.is_cuda or _interpreting())


def tiled_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, cfg: GemmConfig,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) with the given tile config. x [..., K] (rows may be strided),
    weight [N, K], bias [N] or None; returns [..., N] (written into `out` when given, a [rows, N] view
    with unit inner stride)."""
    k = x.shape[-1]
    n = weight.shape[0]
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    y = out if out is not None else torch.empty(m, n, dtype=x.dtype, device=x.device)
    k_tiles = triton.cdiv(k, cfg.block_k)
    split = max(1, min(cfg.split_k, k_tiles))
    k_per_split = triton.cdiv(k_tiles, split) * cfg.block_k
    split = triton.cdiv(k, k_per_split)            # no empty splits
    ieee, upcast = _dot_flags(x.dtype)
    part = torch.empty(split, m, n, dtype=torch.float32, device=x.device) if split > 1 else y
    tiles = triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n)
    _gemm_kernel[(tiles, split)](
        x2, weight, bias if bias is not None else weight, y, part, m, n, k, k_per_split,
        x2.stride(0), weight.stride(0), y.stride(0),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, HAS_BIAS=bias is not None,
        SPLIT=split > 1, EVEN_K=k % cfg.block_k == 0, IEEE=ieee, UPCAST=upcast,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if split > 1:
        block = 1024
        _split_reduce_kernel[(triton.cdiv(m * n, block),)](
            part, bias if bias is not None else weight, y, m, n, y.stride(0), SPLIT_K=split,
            HAS_BIAS=bias is not None, BLOCK=block, num_warps=4)
    return y.view(*x.shape[:-1], n) if out is None else y
