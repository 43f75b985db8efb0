"""Start-up compilation of every attention kernel variant a step can need."""

from __future__ import annotations

import itertools

import torch

from pagoda.kernels import dispatch
from pagoda.kernels.attention.decode import paged_decode_attention
from pagoda.kernels.attention.prefill import build_prefill_tiles, paged_prefill_attention
from pagoda.kernels.attention.store_kv import store_kv


def compile_variants(
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device | str,
    cache_dtype: torch.dtype | None = None,
) -> None:
    """Launch each kernel once in every variant a step can need for this attention shape, on a tiny
    scratch cache, so Triton compiles them at start-up rather than inside a step (a compile stalls
    every running request for ~0.5 s). The variants are the launch constexprs that differ between
    steps: decode with and without a query index (mixed vs pure-decode steps), each with one split
    and with several (then the in-kernel merge); prefill; store_kv. What else changes from step to
    step (row counts, block-table widths, split counts) is passed as unspecialised runtime integers.
    Each once with and once without PDL: steps (eager or captured) of more than
    `policy.PDL_MAX_ROWS` tokens launch without it (`dispatch.pdl_for_rows`). cache_dtype: the
    cache's element type (None: dtype; `FP8` compiles the fp8-cache variants)."""
    for pdl_on in (True, False):
        with dispatch.pdl_allowed(pdl_on):
            _launch_variants(num_heads, num_kv_heads, head_dim, block_size, dtype, device, cache_dtype or dtype)


def _launch_variants(
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device | str,
    cache_dtype: torch.dtype,
) -> None:
    blocks = 3
    k_cache = torch.zeros(blocks, block_size, num_kv_heads, head_dim, dtype=cache_dtype, device=device)
    v_cache = torch.zeros_like(k_cache)
    tables = torch.tensor([[1, 2]], dtype=torch.int32, device=device)
    q = torch.zeros(2, num_heads, head_dim, dtype=dtype, device=device)
    kv = torch.zeros(2, num_kv_heads, head_dim, dtype=dtype, device=device)
    store_kv(kv, kv, k_cache, v_cache, torch.tensor([block_size, block_size + 1], device=device))
    seq_len = torch.tensor([2], dtype=torch.int32, device=device)
    for splits, index in itertools.product((1, 2), (None, torch.tensor([1], dtype=torch.int32, device=device))):
        paged_decode_attention(
            q if index is not None else q[:1], k_cache, v_cache, tables, seq_len, 1.0, splits, query_index=index
        )
    paged_prefill_attention(
        q,
        k_cache,
        v_cache,
        tables,
        torch.tensor([0, 2], dtype=torch.int32, device=device),
        seq_len,
        1.0,
        tiles=build_prefill_tiles([2], [0], device),
    )
