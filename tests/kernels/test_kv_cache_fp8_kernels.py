"""The Triton KV-cache kernels with an fp8 (e4m3) cache and non-unit per-tensor scales.

Stores (`store_kv`, and the fused RoPE store) must write exactly torch's own rounding of the fp32
value x / scale clamped to ±448 (`.to(torch.float8_e4m3fn)`), bit for bit, padding slots untouched.
Decode (one split and several) and prefill must equal a float64 attention over what the cache
holds, dequantized (float(q) * scale) — to fp32 rounding for fp32 queries, to bf16 rounding for bf16
ones: the kernels fold the scales into fp32 arithmetic instead of scaling each element, which is the
same function. Slots nothing wrote hold NaN, so a read past a row's length shows. Shapes stay tiny
(the interpreter runs them on the CPU); a GPU runs the same tests natively.
"""

from __future__ import annotations

import dataclasses
import platform
import sys

import pytest
import torch

if not (sys.platform == "linux" and platform.machine() == "x86_64"):
    pytest.importorskip("triton")

from pagoda.kernels import rotary as rotary_kernels
from pagoda.kernels.attention.decode import paged_decode_attention
from pagoda.kernels.attention.prefill import paged_prefill_attention
from pagoda.kernels.attention.store_kv import store_kv
from pagoda.kernels.attention.warmup import compile_variants
from pagoda.layers.attention import quantize_kv
from pagoda.layers.rotary import RotaryEmbedding
from pagoda.layers.torch_attention import TorchAttentionBackend
from pagoda.layers.triton_attention import TritonAttentionBackend
from tests.kernels.test_attention import DECODE_ONLY, MIXED, PREFILL_ONLY, TOL, Case, dense_attention, make_case

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FP8 = torch.float8_e4m3fn
K_SCALE, V_SCALE = 0.043, 1.7  # not powers of two: a scale used the wrong way round changes the values


def torch_fp8(x: torch.Tensor, scale: float) -> torch.Tensor:
    """The reference rounding, written out here: torch's cast of the clamped fp32 quotient, divided on the
    CPU (IEEE division; on CUDA torch multiplies by a scalar divisor's reciprocal instead), on x's device."""
    return torch.clamp(x.float().cpu() / scale, -448.0, 448.0).to(torch.float8_e4m3fn).to(x.device)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8).cpu()


def same_fp8(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-identical e4m3 values (the Triton stores and `quantize_kv` both divide with IEEE rounding)."""
    return torch.equal(bits(a), bits(b))


def slots_of(case: Case, row: int, start: int, end: int) -> torch.Tensor:
    bs = case.batch.block_size
    pos = torch.arange(start, end, device=case.batch.block_tables.device)
    return case.batch.block_tables[row, pos // bs] * bs + pos % bs


def nan_fp8(shape: torch.Size) -> torch.Tensor:
    return torch.full(shape, float("nan"), device=DEVICE).to(FP8)


def with_fp8_cache(case: Case, cached_only: bool) -> Case:
    """The case's K/V stored into NaN-filled fp8 caches by `store_kv` (all tokens, or only the cached
    prefixes, leaving the step's new tokens to the backend's own store)."""
    k8, v8 = nan_fp8(case.k_cache.shape), nan_fp8(case.v_cache.shape)
    spec_new = case.batch.query_lens
    for row, seq_len in enumerate(case.batch.seq_lens):
        end = seq_len - spec_new[row] if cached_only else seq_len
        if end:
            slots = slots_of(case, row, 0, end)
            keys, values = case.keys[row][:end].to(DEVICE), case.values[row][:end].to(DEVICE)
            store_kv(keys, values, k8, v8, slots, K_SCALE, V_SCALE)
    return dataclasses.replace(case, k_cache=k8, v_cache=v8)


def dequantized_reference(case: Case) -> torch.Tensor:
    """float64 attention over what the fp8 caches hold at each request's positions, times the scales."""
    hkv, d = case.k_cache.shape[2:]
    flat_k, flat_v = case.k_cache.view(-1, hkv, d), case.v_cache.view(-1, hkv, d)
    keys, values = [], []
    for row, seq_len in enumerate(case.batch.seq_lens):
        slots = slots_of(case, row, 0, seq_len)
        keys.append(flat_k[slots].cpu().double() * K_SCALE)
        values.append(flat_v[slots].cpu().double() * V_SCALE)
    assert not any(k.isnan().any() for k in keys), "a position the case needs was never stored"
    return dense_attention(dataclasses.replace(case, keys=keys, values=values))


def close(out: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    assert not out.isnan().any(), "NaN: an unwritten cache slot was read"
    torch.testing.assert_close(out.cpu().double(), expected.double(), **TOL[dtype])


# ---- stores -------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_store_kv_rounds_like_torch(dtype: torch.dtype) -> None:
    """Magnitudes from e4m3's subnormals (< 2^-6 after scaling) to past its 448 (saturating), both
    signs, ties and carries into the next power of two; a -1 slot writes nothing."""
    g = torch.Generator().manual_seed(0)
    t, hkv, d, block = 6, 2, 16, 4
    magnitudes = torch.logspace(-5, 3.5, t * hkv * d).view(t, hkv, d)
    k = (torch.randn(t, hkv, d, generator=g).sign() * magnitudes * K_SCALE).to(dtype)
    v = (torch.randn(t, hkv, d, generator=g) * 3 * V_SCALE).to(dtype)
    k[0, 0, :4] = torch.tensor([15.75, 31.5, 0.0, -0.0]) * K_SCALE  # ties to even; a carry to 32
    k[0, 0, 4] = -1e-7  # rounds to -0
    k, v = k.to(DEVICE), v.to(DEVICE)
    slots = torch.tensor([5, 0, 17, -1, 9, 23], device=DEVICE)
    k_cache, v_cache = nan_fp8(torch.Size((6, block, hkv, d))), nan_fp8(torch.Size((6, block, hkv, d)))
    store_kv(k, v, k_cache, v_cache, slots, K_SCALE, V_SCALE)

    written = slots >= 0
    flat_k, flat_v = k_cache.view(-1, hkv, d), v_cache.view(-1, hkv, d)
    assert torch.equal(bits(flat_k[slots[written]]), bits(torch_fp8(k[written], K_SCALE)))
    assert torch.equal(bits(flat_v[slots[written]]), bits(torch_fp8(v[written], V_SCALE)))
    assert same_fp8(quantize_kv(k, K_SCALE), torch_fp8(k, K_SCALE))  # the torch backend's store
    assert flat_k[slots[written]].float().abs().max() == 448.0  # saturated, not NaN
    untouched = torch.ones(flat_k.shape[0], dtype=torch.bool, device=DEVICE)
    untouched[slots[written]] = False
    assert flat_k[untouched].float().isnan().all() and flat_v[untouched].float().isnan().all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("d,rotary_dim", [(16, 16), (16, 8)], ids=["full", "partial"])
def test_rotary_store_kv_fp8_is_rotary_then_store(d: int, rotary_dim: int, dtype: torch.dtype) -> None:
    """The fused RoPE + store quantizes what `rotary` then `store_kv` would store, bit for bit."""
    g = torch.Generator().manual_seed(1)
    t, hq, hkv = 4, 4, 2
    qkv = (torch.randn(t, (hq + 2 * hkv) * d, generator=g) * 2).to(dtype).to(DEVICE)
    q, k, v = (x.view(t, -1, d) for x in qkv.split([hq * d, hkv * d, hkv * d], dim=-1))
    cos_sin = RotaryEmbedding(rotary_dim, 64, 10000.0, None).cos_sin(torch.tensor([0, 5, 17, 3], device=DEVICE))
    slots = torch.tensor([9, -1, 0, 13], device=DEVICE)
    shape = torch.Size((5, 4, hkv, d))
    k_ref, v_ref = nan_fp8(shape), nan_fp8(shape)
    q_ref, k_rot = rotary_kernels.rotary(q, k, *cos_sin)
    store_kv(k_rot, v, k_ref, v_ref, slots, K_SCALE, V_SCALE)
    k_cache, v_cache = nan_fp8(shape), nan_fp8(shape)
    assert rotary_kernels.supports_rotary_store_kv(q, k, v, *cos_sin, k_cache, v_cache)
    q_out = rotary_kernels.rotary_store_kv(q, k, v, *cos_sin, k_cache, v_cache, slots, K_SCALE, V_SCALE)
    assert torch.equal(q_out, q_ref)
    assert torch.equal(bits(k_cache), bits(k_ref)) and torch.equal(bits(v_cache), bits(v_ref))


# ---- attention over an fp8 cache ----------------------------------------------------------------


@pytest.mark.parametrize("num_heads,num_kv_heads,num_splits", [(4, 4, 1), (8, 2, 3)])
def test_decode_over_fp8_cache(num_heads: int, num_kv_heads: int, num_splits: int) -> None:
    case = with_fp8_cache(make_case(DECODE_ONLY, num_heads, num_kv_heads, 16, 4, seed=num_splits), cached_only=False)
    out = paged_decode_attention(
        case.q,
        case.k_cache,
        case.v_cache,
        case.batch.block_tables.to(torch.int32),
        case.batch.seq_lens_tensor.to(torch.int32),
        case.scale,
        num_splits,
        k_scale=K_SCALE,
        v_scale=V_SCALE,
    )
    close(out, dequantized_reference(case), torch.float32)


def test_prefill_over_fp8_cache() -> None:
    case = with_fp8_cache(make_case(PREFILL_ONLY, 8, 2, 32, 4, seed=2), cached_only=False)
    out = paged_prefill_attention(
        case.q,
        case.k_cache,
        case.v_cache,
        case.batch.block_tables,
        case.batch.query_start_loc,
        case.batch.seq_lens_tensor,
        case.scale,
        k_scale=K_SCALE,
        v_scale=V_SCALE,
    )
    close(out, dequantized_reference(case), torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_backends_agree_on_a_mixed_step_over_fp8_cache(dtype: torch.dtype) -> None:
    """One mixed step (decode rows between prefill chunks after cached prefixes) through the Triton
    backend and through the PyTorch one, each storing the step's K/V itself: the same cache bits, and
    both outputs equal the dequantized reference."""
    case = with_fp8_cache(make_case(MIXED, 8, 2, 16, 4, dtype=dtype, seed=3), cached_only=True)
    torch_case = dataclasses.replace(
        case,
        # The PyTorch backend reads whole blocks: it needs them finite (the runner zeroes them).
        k_cache=torch.where(case.k_cache.float().isnan(), 0.0, case.k_cache.float()).to(FP8),
        v_cache=torch.where(case.v_cache.float().isnan(), 0.0, case.v_cache.float()).to(FP8),
    )
    outs = []
    for backend, c in ((TritonAttentionBackend(decode_splits=2), case), (TorchAttentionBackend(), torch_case)):
        meta = backend.prepare(c.batch)
        outs.append(backend.forward(c.q, c.k, c.v, c.k_cache, c.v_cache, meta, c.scale, K_SCALE, V_SCALE))
    written = case.batch.slot_mapping
    hkv, d = case.k_cache.shape[2:]
    for a, b in ((case.k_cache, torch_case.k_cache), (case.v_cache, torch_case.v_cache)):
        assert same_fp8(a.view(-1, hkv, d)[written], b.view(-1, hkv, d)[written])
    expected = dequantized_reference(case)
    for out in outs:
        assert out.dtype == dtype
        close(out, expected, dtype)


def test_warm_up_runs_the_fp8_variants() -> None:
    compile_variants(4, 2, 16, 4, torch.float32, DEVICE, FP8)


# ---- the engine on the Triton backend ------------------------------------------------------------


def test_yuan_engine_on_triton_matches_torch_with_fp8_cache():
    """Yuan2 (partial RoPE, the LF state beside the cache) with an fp8 cache: the Triton backend, its
    cache NaN wherever nothing was stored, gives the PyTorch backend's greedy tokens through chunked
    prefill and a prefix-cache hit; the LF state stays in the model dtype."""
    import json

    from pagoda.config import EngineArgs, EngineConfig
    from pagoda.engine.llm_engine import LLMEngine
    from pagoda.sampling_params import SamplingParams
    from tests.conftest import FIXTURES

    cases = json.loads((FIXTURES / "yuan2-tiny" / "golden.json").read_text())["cases"][3:4]  # 23 tokens
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=3)
    results = {}
    for backend in ("triton", "torch"):
        args = EngineArgs(
            model=str(FIXTURES / "yuan2-tiny"),
            skip_tokenizer_init=True,
            dtype="float32",
            kv_cache_dtype="fp8",
            attention_backend=backend,
            max_num_batched_tokens=8,
            block_size=4,
            num_gpu_blocks_override=80,
            device=DEVICE,
        )
        engine = LLMEngine(EngineConfig.create(args))
        runner = engine.runner
        assert all(k.dtype == v.dtype == FP8 for k, v in runner.kv_caches)
        assert runner.state_pool is not None and runner.state_pool.state.dtype == torch.float32
        if backend == "triton":
            for k, v in runner.kv_caches:
                k[1:].fill_(float("nan"))
                v[1:].fill_(float("nan"))
        done = {}
        for round_ in range(2):  # the second round hits the prefix cache
            for i, case in enumerate(cases):
                engine.add_request(f"{round_}-{i}", case["prompt_ids"], params)
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished:
                        done[out.request_id] = out.outputs[0]
        assert engine.block_manager.prefix_hits > 0 and engine.scheduler.stats.num_chunked_prefills > 0
        results[backend] = done
    for rid, out in results["triton"].items():
        ref = results["torch"][rid]
        assert out.token_ids == ref.token_ids, rid
        first, first_ref = out.logprobs[0], ref.logprobs[0]
        assert max(abs(first[t].logprob - first_ref[t].logprob) for t in first_ref) < 1e-4
