"""Few-row matmul (GEMV) in Triton: y [M, N] = x [M, K] @ W [N, K]ᵀ (+ bias, or + y) for few rows M.

Why: at decode batch 1 a step is a serial chain of weight streams, and cuBLAS picks latency-bound
kernels for them. At M = 1 this kernel beats cuBLAS on every Yuan2-2B matmul, measured inside CUDA
graphs with the weights cycled out of L2 by `benchmarks/kernels/gemv_sweep.py` (summary in
docs/performance.md). An earlier Triton attempt (`tl.dot` tiles of 16 rows, split K with a second reduce
kernel) was no faster than cuBLAS: the gain comes from issuing all of a program's weight loads at once over
very many small programs, in one launch. With PDL (`pagoda/kernels/pdl.py`) the first weight tile is loaded
before waiting for the previous kernel.

Shape of the work: program p owns BLOCK_N (2-4) output columns for all M rows, so each weight byte
is read once. Per K tile it loads a [BLOCK_N, BLOCK_K] weight tile (BLOCK_K up to 4096: one or
two tiles cover K for these models) and the rows of x (L2-resident, re-read by every program),
multiplies in fp32 on the CUDA cores (no tensor cores: at a few rows a GEMV is a weight stream,
arithmetic is free) and reduces along K. Thousands of programs keep every SM loading. Three paths:
- the row loop (K within one tile, any M): the tile is loaded once and each row is reduced against it
  in turn, exactly as a one-row call reduces its row — so a row's result never depends on how many rows
  share the call (a speculative verification's rows equal plain decode steps bit for bit). Its cost grows
  with the rows (every program re-reads each row of x), so `policy.GEMV_LOOP_ROWS` bounds the rows by
  weight size, and beyond that cuBLAS runs (`max_rows_for`);
- one row, K in several tiles: the tiles are streamed and summed;
- several rows, K in several tiles: a [ROWS, BLOCK_N, BLOCK_K] product per tile (tests and explicit calls;
  the policy sends such matmuls to cuBLAS).

Numerics: exact bf16/fp16 products (fp32 inputs: rounded products) summed in fp32 (as cuBLAS
does, in a different order), plus the bias or the existing y in fp32, rounded once to the output
dtype. So results match `F.linear` / `torch.addmm` to within fp32 accumulation order: an ulp of the
output dtype on some elements. The reference is `F.linear` in float64 (tests/kernels/test_gemv.py).

The launcher checks shapes, dtypes and strides, never reads device values, and takes its config
from `gemv_config` (a rule fitted to the sweeps, a function of the shape only).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pagoda import envs
from pagoda.kernels import pdl, policy
from pagoda.kernels.activation import silu_mul
from pagoda.kernels.pdl import wait_for_inputs
from pagoda.kernels.triton_utils import DTYPES, interpreting, round_to

MAX_BLOCK_K = 4096
LOOP_ROWS = envs.GEMV_LOOP_ROWS.value  # A/B switch (None: the policy's); 1 keeps matmuls of several rows on cuBLAS


@dataclass(frozen=True)
class GemvConfig:
    block_n: int
    block_k: int
    num_warps: int


@triton.jit
def _weight_tile(w_rows, k, mask_n, K, EVEN: tl.constexpr):
    """The [BLOCK_N, BLOCK_K] weight tile at columns k; EVEN: no mask needed (K and N divide)."""
    if EVEN:
        return tl.load(w_rows + k[None, :], eviction_policy="evict_first")
    return tl.load(
        w_rows + k[None, :], mask=mask_n[:, None] & (k < K)[None, :], other=0.0, eviction_policy="evict_first"
    )


@triton.jit
def _x_vector(x_ptr, k, K, EVEN: tl.constexpr):
    if EVEN:
        return tl.load(x_ptr + k)
    return tl.load(x_ptr + k, mask=k < K, other=0.0)


@triton.jit
def _gemv_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    b_ptr,
    y_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_ym,
    ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    ACCUMULATE: tl.constexpr,
    EVEN_K: tl.constexpr,
    EVEN_N: tl.constexpr,
    EMULATE_BF16: tl.constexpr,
    PDL: tl.constexpr,
    ROW_LOOP: tl.constexpr,
):
    """Program p: columns [p·BLOCK_N, (p+1)·BLOCK_N) of rows 0..M-1 (ROWS ≥ M, a power of two).
    EVEN_K / EVEN_N: K % BLOCK_K == 0 / N % BLOCK_N == 0, so no mask on that axis.
    ACCUMULATE: y += x·Wᵀ (y's old value read first). HAS_SCALE: W is fp8 and column n's sum is
    multiplied by s[n] (float32) before the bias."""
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_n = offs_n < N
    w_rows = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn  # [BLOCK_N, 1]
    if ROW_LOOP:
        # K fits one tile: the weight tile is loaded once (before the PDL wait: weights are never
        # written, so their stream overlaps the previous kernel's tail) and each of the ROWS rows (rows
        # past M masked) is reduced against it exactly as a one-row call reduces its row (same tile, same
        # layout), so a row's result does not depend on how many rows share the call. The loop is
        # unrolled so that every row's loads are in flight at once.
        w = _weight_tile(w_rows, offs_k, mask_n, K, EVEN_K and EVEN_N).to(tl.float32)
        wait_for_inputs(PDL)
        for m in tl.static_range(ROWS):
            if ROWS == 1:  # M == 1: the row needs no mask
                x = _x_vector(x_ptr, offs_k, K, EVEN_K)
            else:
                x = tl.load(x_ptr + m * stride_xm + offs_k, mask=(offs_k < K) & (m < M), other=0.0)
            acc1 = tl.sum(w * x.to(tl.float32)[None, :], axis=1)
            rows_m = m + tl.arange(0, 1)
            _store_rows(
                acc1[None, :], rows_m, offs_n, M, N, s_ptr, b_ptr, y_ptr, stride_ym, HAS_BIAS, HAS_SCALE, ACCUMULATE,
                EMULATE_BF16,
            )  # fmt: skip
    else:
        if ROWS == 1:
            # One row, K in several tiles: [BLOCK_N, BLOCK_K] tiles times a [BLOCK_K] vector. Kept 2-D: the 3-D
            # form below with a unit leading axis gets a load layout that streams slower on the H200
            # (gemv_sweep). The first weight tile is loaded before waiting for the previous kernel (PDL).
            w = _weight_tile(w_rows, offs_k, mask_n, K, EVEN_K and EVEN_N)
            wait_for_inputs(PDL)
            x = _x_vector(x_ptr, offs_k, K, EVEN_K)
            acc1 = tl.sum(w.to(tl.float32) * x.to(tl.float32)[None, :], axis=1)
            for k0 in range(BLOCK_K, K, BLOCK_K):
                k = k0 + offs_k
                w = _weight_tile(w_rows, k, mask_n, K, EVEN_K and EVEN_N)
                x = _x_vector(x_ptr, k, K, EVEN_K)
                acc1 += tl.sum(w.to(tl.float32) * x.to(tl.float32)[None, :], axis=1)
            acc = acc1[None, :]  # [1, BLOCK_N]
            offs_m = tl.arange(0, 1)
        else:
            wait_for_inputs(PDL)
            offs_m = tl.arange(0, ROWS)
            mask_m = offs_m < M
            x_rows = x_ptr + offs_m[:, None] * stride_xm  # [ROWS, 1]
            acc = tl.zeros([ROWS, BLOCK_N], dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                k = k0 + offs_k
                mask_k = k < K
                w = _weight_tile(w_rows, k, mask_n, K, False)
                x = tl.load(x_rows + k[None, :], mask=mask_m[:, None] & mask_k[None, :], other=0.0)
                acc += tl.sum(x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)
        _store_rows(
            acc, offs_m, offs_n, M, N, s_ptr, b_ptr, y_ptr, stride_ym, HAS_BIAS, HAS_SCALE, ACCUMULATE, EMULATE_BF16
        )


@triton.jit
def _store_rows(
    acc,
    offs_m,
    offs_n,
    M,
    N,
    s_ptr,
    b_ptr,
    y_ptr,
    stride_ym,
    HAS_BIAS: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    ACCUMULATE: tl.constexpr,
    EMULATE_BF16: tl.constexpr,
):
    """y[offs_m, offs_n] = acc (float32 [R, BLOCK_N] sums) · scale + y + bias, rounded once."""
    mask_n = offs_n < N
    out_mask = (offs_m < M)[:, None] & mask_n[None, :]
    y_ptrs = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :]
    if HAS_SCALE:
        acc *= tl.load(s_ptr + offs_n, mask=mask_n, other=0.0)[None, :]
    if ACCUMULATE:
        acc += tl.load(y_ptrs, mask=out_mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptrs, round_to(acc, y_ptr, EMULATE_BF16), mask=out_mask)


@triton.jit
def _gemv_silu_and_mul_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    y_ptr,
    N,
    K,
    stride_wn,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    EVEN_K: tl.constexpr,
    EVEN_N: tl.constexpr,
    PRECISE_EXP: tl.constexpr,
    EMULATE_BF16: tl.constexpr,
    PDL: tl.constexpr,
):
    """One row, W [2N, K] = [activated | linear]: y[n] = silu(x·W[n]) * (x·W[N + n]), each product
    rounded to the dtype first, so y equals `silu_and_mul(gemv(x, W))` bit for bit while the [2N]
    intermediate never goes to memory and the SiLU kernel's launch is saved. Program p owns columns
    [p·BLOCK_N, (p+1)·BLOCK_N) of both halves. HAS_SCALE: W is fp8, row r's sum times s[r] (float32)."""
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_n = offs_n < N
    a_rows = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn
    b_rows = w_ptr + (offs_n[:, None] + N).to(tl.int64) * stride_wn
    wa = _weight_tile(a_rows, offs_k, mask_n, K, EVEN_K and EVEN_N)  # before the wait, as in gemv
    wb = _weight_tile(b_rows, offs_k, mask_n, K, EVEN_K and EVEN_N)
    wait_for_inputs(PDL)
    x = _x_vector(x_ptr, offs_k, K, EVEN_K).to(tl.float32)
    acc_a = tl.sum(wa.to(tl.float32) * x[None, :], axis=1)
    acc_b = tl.sum(wb.to(tl.float32) * x[None, :], axis=1)
    for k0 in range(BLOCK_K, K, BLOCK_K):
        k = k0 + offs_k
        x = _x_vector(x_ptr, k, K, EVEN_K).to(tl.float32)
        acc_a += tl.sum(_weight_tile(a_rows, k, mask_n, K, EVEN_K and EVEN_N).to(tl.float32) * x[None, :], axis=1)
        acc_b += tl.sum(_weight_tile(b_rows, k, mask_n, K, EVEN_K and EVEN_N).to(tl.float32) * x[None, :], axis=1)
    if HAS_SCALE:
        acc_a *= tl.load(s_ptr + offs_n, mask=mask_n, other=0.0)
        acc_b *= tl.load(s_ptr + N + offs_n, mask=mask_n, other=0.0)
    a = round_to(acc_a, y_ptr, EMULATE_BF16)
    b = round_to(acc_b, y_ptr, EMULATE_BF16)
    tl.store(y_ptr + offs_n, silu_mul(a, b, y_ptr, PRECISE_EXP, EMULATE_BF16), mask=mask_n)


def gemv_config(m: int, n: int, k: int) -> GemvConfig:
    """Two output columns per program, K in tiles of up to 4096 (one tile for K ≤ 4096), 4 warps: in
    an H200 sweep of this loop over 5 column counts x 5 K tiles x 3 warp counts it was within noise
    of the best config for every Yuan2-2B matmul at M = 1 (`benchmarks/kernels/gemv_sweep.py --grid-rows 1`).
    A very wide weight of short rows (an LM head over a small hidden size) takes four columns per program:
    two leave each program too few bytes to stream (SmolLM2-135M's 49152 x 576 head at one row: 30.8 → 20.0 µs).
    The config depends on the shape only, never on m: a row's reduction is the same at any row count."""
    block_n = 4 if n >= 32768 and k <= 1024 else 2
    if interpreting():
        return GemvConfig(block_n=block_n, block_k=min(triton.next_power_of_2(k), 32), num_warps=1)
    return GemvConfig(block_n=block_n, block_k=min(triton.next_power_of_2(k), MAX_BLOCK_K), num_warps=4)


def max_rows_for(weight: torch.Tensor) -> int:
    """How many rows of x the GEMV takes for this weight: `policy.GEMV_MAX_ROWS`, or more where the row loop runs
    (K within one tile): `policy.GEMV_LOOP_ROWS`'s bound for the weight's size, or PAGODA_GEMV_LOOP_ROWS's."""
    n, k = weight.shape
    if k <= MAX_BLOCK_K:
        for max_weight, rows in policy.GEMV_LOOP_ROWS:
            if n * k <= max_weight:
                return max(policy.GEMV_MAX_ROWS, rows if LOOP_ROWS is None else LOOP_ROWS)
    return policy.GEMV_MAX_ROWS


def supports(
    x: torch.Tensor, weight: torch.Tensor, max_rows: int | None = None, weight_scale: torch.Tensor | None = None
) -> bool:
    """Whether `gemv` takes this matmul: on CUDA (or the interpreter), at most max_rows (default
    `max_rows_for(weight)`) rows of x, one dtype (or an fp8 e4m3 weight with a float32 [N] weight_scale), unit
    inner strides, W [N, K] with K = x's last dim."""
    if x.dim() < 1 or weight.dim() != 2:
        return False
    max_rows = max_rows_for(weight) if max_rows is None else max_rows
    k = x.shape[-1]
    # the row bound first: the common rejection (every prefill matmul) costs a few comparisons on the host
    if not 0 < x.numel() <= max_rows * k:
        return False
    if weight_scale is not None:
        scaled = weight.dtype == torch.float8_e4m3fn and weight_scale.dtype == torch.float32
        if not scaled or weight_scale.shape != weight.shape[:1] or weight_scale.stride(0) != 1:
            return False
    elif weight.dtype != x.dtype:
        return False
    if x.dtype not in DTYPES:
        return False
    return weight.shape[1] == k and weight.stride(1) == 1 and (x.is_cuda or interpreting())


def gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    accumulate: bool = False,
    config: GemvConfig | None = None,
    weight_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """F.linear(x, weight, bias) for few rows: x [..., K], weight [N, K], bias [N] → [..., N].

    weight_scale: float32 [N] for an fp8 (e4m3) weight: the result is F.linear(x, weight · s, bias),
    each column's fp32 sum scaled once (the fp8 values widen exactly to fp32).

    out: a [M, N] tensor to write (unit column stride; any row stride), of x's dtype or float32 (then
    nothing is rounded: a partial sum another GEMV adds as its bias); with accumulate=True the
    result is out + x·Wᵀ (+ bias), like `out.addmm_(x, weight.t())`. bias may be float32 too."""
    k = x.shape[-1]
    n = weight.shape[0]
    if weight.shape[1] != k or weight.stride(1) != 1:
        raise ValueError(f"weight must be [N, {k}] with contiguous rows, got {tuple(weight.shape)}")
    x2 = x.reshape(-1, k)
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    if out is None:
        if accumulate:
            raise ValueError("accumulate=True needs out")
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    elif out.shape != (m, n) or out.stride(1) != 1 or out.dtype not in (x.dtype, torch.float32):
        raise ValueError(f"out must be a [{m}, {n}] {x.dtype} or float32 tensor with unit column stride")
    if bias is not None and (bias.shape != (n,) or bias.stride(0) != 1 or bias.dtype not in (x.dtype, torch.float32)):
        raise ValueError(f"bias must be a contiguous [{n}] vector of {x.dtype} or float32")
    config = config or gemv_config(m, n, k)
    if weight_scale is not None and (weight_scale.shape != (n,) or weight_scale.dtype != torch.float32):
        raise ValueError(f"weight_scale must be a float32 [{n}] vector")
    row_loop = k <= config.block_k  # K within one tile: the tile is loaded once and the rows reduced in turn
    _gemv_kernel[(triton.cdiv(n, config.block_n),)](
        x2,
        weight,
        weight_scale if weight_scale is not None else out,
        bias if bias is not None else out,
        out,
        m,
        n,
        k,
        x2.stride(0),
        weight.stride(0),
        out.stride(0),
        ROWS=triton.next_power_of_2(m),
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        HAS_BIAS=bias is not None,
        HAS_SCALE=weight_scale is not None,
        ACCUMULATE=accumulate,
        EVEN_K=k % config.block_k == 0,
        EVEN_N=n % config.block_n == 0,
        EMULATE_BF16=interpreting() and x.dtype == torch.bfloat16,
        ROW_LOOP=row_loop,
        num_warps=config.num_warps,
        **pdl.launch_args(x),
    )
    return out.reshape(*x.shape[:-1], n) if x.dim() != 2 else out


def gemv_silu_and_mul(
    x: torch.Tensor,
    weight: torch.Tensor,
    config: GemvConfig | None = None,
    weight_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """silu_and_mul(F.linear(x, weight)) for one row: x [..., K] (one row), weight [2I, K] laid out
    [activated | linear] → [..., I], rounded like the two kernels it replaces. weight_scale: float32
    [2I] for an fp8 weight, as in `gemv`."""
    k = x.shape[-1]
    if weight.dim() != 2 or weight.shape[0] % 2 or weight.shape[1] != k or weight.stride(1) != 1:
        raise ValueError(f"weight must be [2I, {k}] with contiguous rows, got {tuple(weight.shape)}")
    x2 = x.reshape(-1, k)
    if x2.shape[0] != 1:
        raise ValueError(f"gemv_silu_and_mul takes one row, got {x2.shape[0]}")
    x2 = x2 if x2.stride(1) == 1 else x2.contiguous()
    n = weight.shape[0] // 2
    if weight_scale is not None and (weight_scale.shape != (2 * n,) or weight_scale.dtype != torch.float32):
        raise ValueError(f"weight_scale must be a float32 [{2 * n}] vector")
    out = torch.empty((1, n), dtype=x.dtype, device=x.device)
    config = config or gemv_config(1, 2 * n, k)
    block_n = max(1, config.block_n // 2)  # two rows per column: the same weight bytes per program
    _gemv_silu_and_mul_kernel[(triton.cdiv(n, block_n),)](
        x2,
        weight,
        weight_scale if weight_scale is not None else out,
        out,
        n,
        k,
        weight.stride(0),
        BLOCK_N=block_n,
        BLOCK_K=config.block_k,
        HAS_SCALE=weight_scale is not None,
        EVEN_K=k % config.block_k == 0,
        EVEN_N=n % block_n == 0,
        PRECISE_EXP=not interpreting(),
        EMULATE_BF16=interpreting() and x.dtype == torch.bfloat16,
        num_warps=config.num_warps,
        **pdl.launch_args(x),
    )
    return out.reshape(*x.shape[:-1], n)
