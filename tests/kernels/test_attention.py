"""Triton paged attention (store_kv, decode with split-K, prefill) and the Triton backend, checked
against a dense per-request attention written here and against `TorchAttentionBackend`.

Every cache slot that no request has written (spare blocks, the null block 0, block tails past a
request's length) holds NaN: the kernels must mask those reads, where the torch reference needs
zeroed blocks (it gets a NaN-free copy of the same cache). On CPU the kernels run under the Triton
interpreter (`conftest.py`), so shapes stay tiny; on a GPU the same tests run natively.
"""

from __future__ import annotations

import itertools
import platform
import sys
from dataclasses import dataclass

import pytest
import torch

if not (sys.platform == "linux" and platform.machine() == "x86_64"):
    # The test extras install triton only on Linux x86_64; elsewhere a missing triton is expected.
    pytest.importorskip("triton")

from pagoda.kernels import policy
from pagoda.kernels.attention import decode as decode_module
from pagoda.kernels.attention.decode import MAX_SPLITS, choose_num_splits, paged_decode_attention
from pagoda.kernels.attention.prefill import paged_prefill_attention
from pagoda.kernels.attention.store_kv import store_kv
from pagoda.layers.attention import AttentionBatch
from pagoda.layers.torch_attention import TorchAttentionBackend
from pagoda.layers.triton_attention import TritonAttentionBackend, select_attention_backend

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
HEADS = [(4, 4), (4, 2), (8, 1)]  # (Hq, Hkv): MHA, GQA, MQA
HEAD_DIMS = [16, 32]
BLOCK_SIZES = [4, 16]
TOL = {torch.float32: {"atol": 2e-5, "rtol": 1e-4}, torch.bfloat16: {"atol": 3e-2, "rtol": 3e-2}}

# (cached tokens, new tokens) per request; seq_len = cached + new.
DECODE_ONLY = [(0, 1), (6, 1), (12, 1), (40, 1)]  # seq lens 1, 7, 13, 41
PREFILL_ONLY = [(0, 7), (0, 20), (13, 3)]  # 20 > one query tile; cached prefix
MIXED = [(9, 1), (0, 11), (0, 1), (37, 5), (4, 1), (16, 18)]  # decode rows between prefill chunks


@dataclass
class Case:
    """One step: requests' full K/V (dense, for the reference), the paged cache holding their cached
    prefixes (everything else NaN), and the step's new q/k/v in flat token order."""

    batch: AttentionBatch
    q: torch.Tensor  # [T, Hq, D]
    k: torch.Tensor  # [T, Hkv, D] this step's new keys
    v: torch.Tensor
    k_cache: torch.Tensor  # [num_blocks, block_size, Hkv, D], NaN where nothing was written
    v_cache: torch.Tensor
    keys: list[torch.Tensor]  # per request [seq_len, Hkv, D]
    values: list[torch.Tensor]
    scale: float


def make_case(
    spec: list[tuple[int, int]],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    consecutive: bool = False,
    device: str = DEVICE,
) -> Case:
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [c + n for c, n in spec]
    need = [-(-s // block_size) for s in seq_lens]
    num_blocks = 1 + sum(need) + 3  # null block + used + spare
    ids = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()  # scattered, never block 0
    if consecutive:  # each request's blocks one ascending run, as a fresh block manager hands them out
        ids = list(range(1, num_blocks))
    tables = torch.zeros(len(spec), max(need) + 1, dtype=torch.long)  # at least one null-padding column
    for row, n in enumerate(need):
        tables[row, :n] = torch.tensor(ids[:n])
        ids = ids[n:]

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dtype)

    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(cache_shape, float("nan"), dtype=dtype)
    v_cache = torch.full(cache_shape, float("nan"), dtype=dtype)
    keys = [randn(s, num_kv_heads, head_dim) for s in seq_lens]
    values = [randn(s, num_kv_heads, head_dim) for s in seq_lens]
    slots, new_k, new_v = [], [], []
    for row, (cached, new) in enumerate(spec):
        pos = torch.arange(cached + new)
        row_slots = tables[row, pos // block_size] * block_size + pos % block_size
        k_cache.view(-1, num_kv_heads, head_dim)[row_slots[:cached]] = keys[row][:cached]
        v_cache.view(-1, num_kv_heads, head_dim)[row_slots[:cached]] = values[row][:cached]
        slots.append(row_slots[cached:])
        new_k.append(keys[row][cached:])
        new_v.append(values[row][cached:])
    query_lens = [n for _, n in spec]
    starts = torch.zeros(len(spec) + 1, dtype=torch.long)
    starts[1:] = torch.cumsum(torch.tensor(query_lens), 0)
    batch = AttentionBatch(
        query_lens,
        seq_lens,
        starts.to(device),
        torch.tensor(seq_lens, device=device),
        tables.to(device),
        torch.cat(slots).to(device),
        block_size,
    )
    q = randn(sum(query_lens), num_heads, head_dim)
    return Case(
        batch,
        q.to(device),
        torch.cat(new_k).to(device),
        torch.cat(new_v).to(device),
        k_cache.to(device),
        v_cache.to(device),
        keys,
        values,
        head_dim**-0.5,
    )


def dense_attention(case: Case) -> torch.Tensor:
    """Per request, per head: softmax(q K^T * scale) V in fp64, query j at position ctx + j seeing
    keys 0..ctx + j. → [T, Hq, D] fp64 (on the CPU)."""
    outs = []
    starts = case.batch.query_start_loc.tolist()
    group = case.q.shape[1] // case.keys[0].shape[1]
    for row, seq_len in enumerate(case.batch.seq_lens):
        q = case.q[starts[row] : starts[row + 1]].cpu().double()  # [n, Hq, D]
        k = case.keys[row].double().repeat_interleave(group, dim=1)  # [L, Hq, D]
        v = case.values[row].double().repeat_interleave(group, dim=1)
        n = q.shape[0]
        scores = torch.einsum("qhd,khd->hqk", q, k) * case.scale  # [Hq, n, L]
        visible = torch.arange(seq_len)[None, :] <= torch.arange(seq_len - n, seq_len)[:, None]
        scores = scores.masked_fill(~visible, float("-inf"))
        outs.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), v))
    return torch.cat(outs)


def assert_matches(out: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    assert not out.isnan().any(), "output has NaN: an unwritten cache slot was read"
    torch.testing.assert_close(out.cpu().double(), expected.cpu().double(), **TOL[dtype])


def run_backend(backend, case: Case, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
    meta = backend.prepare(case.batch)
    return backend.forward(case.q, case.k, case.v, k_cache, v_cache, meta, case.scale)


def grid(*extra):
    """The (Hq, Hkv) x head_dim x block_size grid, times `extra` parameter lists."""
    return [(*h, d, b, *e) for h, d, b, *e in itertools.product(HEADS, HEAD_DIMS, BLOCK_SIZES, *extra)]


# ---- store_kv -----------------------------------------------------------------------------------


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_store_kv_writes_only_its_slots(block_size: int) -> None:
    num_blocks, num_kv_heads, head_dim = 6, 2, 16
    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(cache_shape, float("nan"), device=DEVICE)
    v_cache = torch.full(cache_shape, float("nan"), device=DEVICE)
    slots = torch.tensor([3, 1 * block_size + 2, 5 * block_size + block_size - 1, -1, 4 * block_size], device=DEVICE)
    kv = torch.randn(len(slots), 2 * num_kv_heads, head_dim, device=DEVICE)  # k/v as strided views of one tensor
    k, v = kv[:, :num_kv_heads], kv[:, num_kv_heads:]
    store_kv(k, v, k_cache, v_cache, slots)

    flat_k, flat_v = k_cache.view(-1, num_kv_heads, head_dim), v_cache.view(-1, num_kv_heads, head_dim)
    written = slots[slots >= 0]
    torch.testing.assert_close(flat_k[written], k[slots >= 0], atol=0, rtol=0)
    torch.testing.assert_close(flat_v[written], v[slots >= 0], atol=0, rtol=0)
    untouched = torch.ones(flat_k.shape[0], dtype=torch.bool, device=DEVICE)
    untouched[written] = False
    assert flat_k[untouched].isnan().all() and flat_v[untouched].isnan().all()  # slot -1 wrote nothing


# ---- kernels called directly ----------------------------------------------------------------------


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,block_size,num_splits", grid([1, 3]))
def test_decode_kernel(num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, num_splits: int) -> None:
    case = make_case(DECODE_ONLY, num_heads, num_kv_heads, head_dim, block_size, seed=num_splits)
    store_kv(case.k, case.v, case.k_cache, case.v_cache, case.batch.slot_mapping)
    out = paged_decode_attention(
        case.q,
        case.k_cache,
        case.v_cache,
        case.batch.block_tables.to(torch.int32),
        case.batch.seq_lens_tensor.to(torch.int32),
        case.scale,
        num_splits,
    )
    assert_matches(out, dense_attention(case), torch.float32)


@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_more_splits_than_tiles_and_padding_rows(num_splits: int) -> None:
    """Short rows leave trailing splits empty; a seq_len 0 row (CUDA-graph padding) yields zeros."""
    case = make_case([(0, 1), (2, 1), (5, 1)], 4, 2, 16, 4)
    store_kv(case.k, case.v, case.k_cache, case.v_cache, case.batch.slot_mapping)
    seq_lens = case.batch.seq_lens_tensor.clone()
    seq_lens[1] = 0
    out = paged_decode_attention(
        case.q, case.k_cache, case.v_cache, case.batch.block_tables, seq_lens, case.scale, num_splits
    )
    expected = dense_attention(case)
    assert_matches(out[[0, 2]], expected[[0, 2]], torch.float32)
    assert (out[1] == 0).all()


def test_decode_split_counters_are_reused_and_left_zero() -> None:
    """The last split of each (row, kv head) merges in-kernel and resets its counter: one buffer
    serves launches of different row counts and split counts back to back (as a decode graph and
    the layers after it do), each matching the dense reference, and ends all zero. A counter left
    non-zero, or a merge by any split but the last, gives wrong outputs in the later launches."""
    from pagoda.kernels.attention.decode import SplitCounters

    counters = SplitCounters()
    for spec, num_heads, num_kv_heads, splits in (
        ([(0, 1), (37, 1), (70, 1)], 8, 2, 5),
        ([(9, 1)], 8, 2, 2),
        (DECODE_ONLY, 6, 3, 7),
        ([(0, 1), (37, 1), (70, 1)], 8, 2, 3),
    ):
        case = make_case(spec, num_heads, num_kv_heads, 16, 4, seed=splits)
        store_kv(case.k, case.v, case.k_cache, case.v_cache, case.batch.slot_mapping)
        rows = len(spec)
        buffer = counters.get(rows, num_kv_heads, torch.device(DEVICE))
        out = paged_decode_attention(
            case.q,
            case.k_cache,
            case.v_cache,
            case.batch.block_tables,
            case.batch.seq_lens_tensor,
            case.scale,
            splits,
            split_counters=buffer,
        )
        assert_matches(out, dense_attention(case), torch.float32)
        assert (buffer == 0).all()
    assert len(counters._buffers) == 1  # 1024 counters cover every launch above


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,block_size", grid())
def test_prefill_kernel(num_heads: int, num_kv_heads: int, head_dim: int, block_size: int) -> None:
    case = make_case(PREFILL_ONLY, num_heads, num_kv_heads, head_dim, block_size)
    store_kv(case.k, case.v, case.k_cache, case.v_cache, case.batch.slot_mapping)
    out = paged_prefill_attention(
        case.q,
        case.k_cache,
        case.v_cache,
        case.batch.block_tables,
        case.batch.query_start_loc,
        case.batch.seq_lens_tensor,
        case.scale,
    )
    assert_matches(out, dense_attention(case), torch.float32)


@pytest.mark.parametrize("head_dim,block_size", [(24, 4), (16, 64)])
def test_odd_head_dim_and_block_larger_than_key_tile(head_dim: int, block_size: int) -> None:
    """head_dim 24 (masked lanes of a 32-wide tile); block_size 64 (> the key tile on CPU and GPU)."""
    case = make_case(MIXED, 4, 2, head_dim, block_size)
    out = run_backend(TritonAttentionBackend(decode_splits=2), case, case.k_cache, case.v_cache)
    assert_matches(out, dense_attention(case), torch.float32)


# ---- the backend against the torch reference --------------------------------------------------------


@pytest.mark.parametrize("spec", [DECODE_ONLY, PREFILL_ONLY, MIXED], ids=["decode", "prefill", "mixed"])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,block_size", grid())
def test_backend_matches_torch_reference(
    spec, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int
) -> None:
    case = make_case(spec, num_heads, num_kv_heads, head_dim, block_size, seed=len(spec))
    ref_k, ref_v = case.k_cache.nan_to_num(0.0), case.v_cache.nan_to_num(0.0)  # the runner's zeroed blocks
    expected = run_backend(TorchAttentionBackend(), case, ref_k, ref_v)
    out = run_backend(TritonAttentionBackend(), case, case.k_cache, case.v_cache)

    assert_matches(out, expected, torch.float32)
    assert_matches(out, dense_attention(case), torch.float32)
    flat = case.k_cache.view(-1, num_kv_heads, head_dim)
    torch.testing.assert_close(flat[case.batch.slot_mapping], case.k, atol=0, rtol=0)
    torch.testing.assert_close(
        case.v_cache.view(-1, num_kv_heads, head_dim)[case.batch.slot_mapping], case.v, atol=0, rtol=0
    )


@pytest.mark.parametrize("decode_splits", [1, 3])
def test_backend_mixed_with_split_decode(decode_splits: int) -> None:
    case = make_case(MIXED, 8, 2, 32, 4, seed=7)
    out = run_backend(TritonAttentionBackend(decode_splits=decode_splits), case, case.k_cache, case.v_cache)
    assert_matches(out, dense_attention(case), torch.float32)


@pytest.mark.parametrize("spec", [DECODE_ONLY, MIXED], ids=["decode", "mixed"])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (8, 1)])
def test_backend_bfloat16(spec, num_heads: int, num_kv_heads: int) -> None:
    case = make_case(spec, num_heads, num_kv_heads, 32, 16, dtype=torch.bfloat16, seed=3)
    ref_k, ref_v = case.k_cache.nan_to_num(0.0), case.v_cache.nan_to_num(0.0)
    expected = run_backend(TorchAttentionBackend(), case, ref_k, ref_v)
    out = run_backend(TritonAttentionBackend(decode_splits=2), case, case.k_cache, case.v_cache)
    assert out.dtype == torch.bfloat16
    assert_matches(out, expected, torch.bfloat16)
    assert_matches(out, dense_attention(case), torch.bfloat16)


FEW_DECODE = DECODE_ONLY[-policy.CPU_KV_VIEW_MAX_ROWS :]  # as many decode rows as are attended in place


@pytest.mark.parametrize("spec", [FEW_DECODE, PREFILL_ONLY, MIXED], ids=["decode", "prefill", "mixed"])
@pytest.mark.parametrize("num_heads,num_kv_heads", HEADS)
def test_torch_backend_attends_consecutive_blocks_in_place(spec, num_heads: int, num_kv_heads: int) -> None:
    """Requests whose blocks are one run are read through views of the cache: on a cache whose unwritten slots
    are NaN (a gathered block's tail would carry them into the output) the result is exact. Host tensors on
    every machine: only a cache in host memory is attended in place."""
    case = make_case(spec, num_heads, num_kv_heads, 16, 4, seed=5, consecutive=True, device="cpu")
    backend = TorchAttentionBackend()
    meta = backend.prepare(case.batch)
    assert all(row.first_slot is not None for row in meta.prefill_rows)
    assert (meta.decode_views is not None) == (meta.decode_blocks is not None)
    out = backend.forward(case.q, case.k, case.v, case.k_cache, case.v_cache, meta, case.scale)
    assert_matches(out, dense_attention(case), torch.float32)


def test_torch_backend_gathers_many_decode_rows_scattered_blocks_and_when_switched_off(monkeypatch) -> None:
    many = [(3 * i, 1) for i in range(policy.CPU_KV_VIEW_MAX_ROWS + 1)]
    for spec, consecutive, switch in ((many, True, "1"), (DECODE_ONLY, False, "1"), (MIXED, True, "0")):
        monkeypatch.setenv("PAGODA_CPU_KV_IN_PLACE", switch)
        case = make_case(spec, 4, 2, 16, 4, seed=6, consecutive=consecutive, device="cpu")
        meta = TorchAttentionBackend().prepare(case.batch)
        assert meta.decode_views is None
        assert all(row.first_slot is None for row in meta.prefill_rows) or switch == "1"
        ref_k, ref_v = case.k_cache.nan_to_num(0.0), case.v_cache.nan_to_num(0.0)  # the runner's zeroed blocks
        out = TorchAttentionBackend().forward(case.q, case.k, case.v, ref_k, ref_v, meta, case.scale)
        assert_matches(out, dense_attention(case), torch.float32)


def _rows_batch(table: list[int], lengths: list[int], slots: list[int], alone: bool) -> AttentionBatch:
    n = len(lengths)
    return AttentionBatch(
        query_lens=[1] * n,
        seq_lens=lengths,
        query_start_loc=torch.arange(n + 1),
        seq_lens_tensor=torch.tensor(lengths),
        block_tables=torch.tensor([table] * n),
        slot_mapping=torch.tensor(slots),
        block_size=4,
        rows_alone=alone,
    )


@pytest.mark.parametrize("table", [[5, 6, 7, 8, 9], [5, 9, 2, 11, 3]], ids=["one run", "scattered"])
def test_rows_alone_are_attended_bit_for_bit_as_one_token_steps(table: list[int]) -> None:
    """A CPU verification step's tokens as decode rows (`AttentionBatch.rows_alone`): each row's output is, bit for
    bit, what a step of that token alone gives after the tokens before it (in place on one run of blocks, else
    its own blocks gathered). A batch of the same rows attended together (gathered to the longest row's blocks)
    rounds differently, which greedy speculation turns into flipped near ties."""
    torch.manual_seed(7)
    hq, hkv, d, bs = 6, 2, 16, 4
    cache = torch.randn(2, 16, bs, hkv, d)
    positions = list(range(13, 18))  # five verified tokens of a 18-token context
    slots = [table[p // bs] * bs + p % bs for p in positions]
    q, k, v = torch.randn(5, hq, d), torch.randn(5, hkv, d), torch.randn(5, hkv, d)
    backend = TorchAttentionBackend()

    alone_k, alone_v = cache[0].clone(), cache[1].clone()
    expected = []
    for i, p in enumerate(positions):  # one-token steps, one after another
        meta = backend.prepare(_rows_batch(table, [p + 1], [slots[i]], alone=False))
        row = slice(i, i + 1)
        expected.append(backend.forward(q[row], k[row], v[row], alone_k, alone_v, meta, 0.25))
    together_k, together_v = cache[0].clone(), cache[1].clone()
    meta = backend.prepare(_rows_batch(table, [p + 1 for p in positions], slots, alone=True))
    got = backend.forward(q, k, v, together_k, together_v, meta, 0.25)
    assert torch.equal(got, torch.cat(expected))
    assert torch.equal(together_k, alone_k) and torch.equal(together_v, alone_v)


# ---- host-side rules ------------------------------------------------------------------------------------


def test_split_rule() -> None:
    assert choose_num_splits(256, 8, 32768, 132) == 1  # big batch fills the GPU already
    assert choose_num_splits(1, 2, 100, 132) == 1  # short sequence: not worth a reduce
    assert choose_num_splits(1, 2, 4096, 132) == 4096 // 256  # length-limited
    assert choose_num_splits(1, 2, 1 << 20, 132) == MAX_SPLITS
    assert choose_num_splits(4, 8, 1 << 20, 132) == 9  # ~2 programs per SM: ceil(264 / 32)
    # (row, kv head) programs at or past the SM count run unsplit (~2 per SM would have split these in two)
    assert choose_num_splits(64, 4, 4096, 132) == 1
    assert choose_num_splits(33, 4, 4096, 132) == 1  # 132 programs
    assert choose_num_splits(32, 4, 4096, 132) == 3  # 128 programs: ceil(264 / 128)


def test_decode_tiles_follow_the_split(monkeypatch) -> None:
    monkeypatch.setattr(decode_module, "interpreting", lambda: False)  # the GPU's rule, not the interpreter's
    assert decode_module.decode_config(128, 9) == decode_module.DecodeConfig(64, 2, 2)  # split: 2 warps
    assert decode_module.decode_config(128, 1) == decode_module.DecodeConfig(64, 4, 2)
    assert decode_module.decode_config(64, 9) == decode_module.DecodeConfig(64, 4, 2)  # not swept: as before
    assert decode_module.decode_config(256, 1) == decode_module.DecodeConfig(32, 4, 2)


def test_select_attention_backend() -> None:
    assert select_attention_backend("cpu").name == "torch"
    assert select_attention_backend("cuda").name == "triton"  # triton imports here (the tests need it)


# ---- start-up compilation -------------------------------------------------------------------------------


def _compiled_kernels() -> int:
    """How many compiled specialisations the attention kernels hold (all devices)."""
    from pagoda.kernels.attention import decode, prefill, store_kv

    fns = (store_kv._store_kv_kernel, decode._decode_kernel, prefill._prefill_kernel)
    return sum(len(cache[0]) for fn in fns for cache in fn.device_caches.values())


@pytest.mark.skipif(DEVICE != "cuda", reason="the interpreter compiles nothing")
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (8, 2)])
def test_warm_up_compiles_every_step_variant(num_heads: int, num_kv_heads: int) -> None:
    """After `warm_up`, steps of any shape the engine can produce — block-table widths 2, 16 or 34
    (Triton would specialise an integer on divisibility by 16), any split count, decode rows with
    and without a query index, prefill rows, with PDL (small graph buckets) and without (eager
    steps, large buckets) — launch without compiling anything new."""
    from pagoda.kernels import dispatch

    head_dim, block_size = 64, 16
    backend = TritonAttentionBackend()
    backend.warm_up({(num_heads, num_kv_heads, head_dim)}, block_size, torch.bfloat16, torch.device(DEVICE))
    compiled = _compiled_kernels()
    for spec, splits, pdl_on in itertools.product(
        (DECODE_ONLY, MIXED, PREFILL_ONLY, [(0, 1)], [(239, 1)], [(520, 1), (3, 1)]),
        (None, 1, 3, 16, 64),
        (True, False),
    ):
        case = make_case(spec, num_heads, num_kv_heads, head_dim, block_size, dtype=torch.bfloat16, seed=5)
        with dispatch.pdl_allowed(pdl_on):
            run_backend(TritonAttentionBackend(decode_splits=splits), case, case.k_cache, case.v_cache)
    torch.cuda.synchronize()
    assert _compiled_kernels() == compiled


def test_warm_up_runs_every_variant_on_cpu() -> None:
    """The start-up launches themselves are valid calls (under the interpreter on CPU)."""
    from pagoda.kernels.attention.warmup import compile_variants

    compile_variants(4, 2, 16, 4, torch.float32, DEVICE)
