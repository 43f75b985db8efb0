"""Tests for pagoda.layers.sampler against naive per-row references written here in plain Python.

The references loop over rows and tokens with Python floats (float64) and sorted lists, so they
share no code with the batched tensor implementation. Where float32 vs float64 rounding could flip
a top-p / min-p decision (a cumulative mass or probability ratio within 1e-4 of its threshold),
that row is skipped and the test asserts that almost every row was still checked.
Tests run on CPU, and on CUDA too when one is visible.
"""

from __future__ import annotations

import math
import random
from collections import Counter

import pytest
import torch

from pagoda.layers.sampler import (
    Sampler,
    SamplerOutput,
    SamplingBatch,
    apply_filters,
    apply_penalties,
)
from pagoda.sampling_params import FLOAT32_MAX, FLOAT32_TINY, SamplingParams

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
NEG_INF = float("-inf")
MARGIN = 1e-4


# ----------------------------------------------------------------------------- naive references


def ref_penalties(
    row: list[float], p: SamplingParams, prompt: list[int], output: list[int], suppress: list[int]
) -> list[float]:
    """Token by token, in vLLM/HF order: repetition, frequency, presence, suppress."""
    x = list(row)
    for t in set(prompt) | set(output):
        x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
    for t, c in Counter(output).items():
        x[t] -= p.frequency_penalty * c
        x[t] -= p.presence_penalty
    for t in suppress:
        x[t] = NEG_INF
    return x


def _softmax(x: dict[int, float]) -> dict[int, float]:
    m = max(x.values())
    e = {i: math.exp(v - m) for i, v in x.items()}
    s = sum(e.values())
    return {i: v / s for i, v in e.items()}


def ref_filter(row: list[float], p: SamplingParams) -> tuple[dict[int, float], float]:
    """Kept token -> logit/temperature after top-k, top-p, min-p; plus the closest float margin seen."""
    x = {i: v / p.temperature for i, v in enumerate(row) if v != NEG_INF}
    margin = math.inf
    if p.top_k > 0 and p.top_k < len(x):
        threshold = sorted(x.values(), reverse=True)[p.top_k - 1]
        x = {i: v for i, v in x.items() if v >= threshold}
    if p.top_p < 1.0:
        probs = _softmax(x)
        kept, mass = {}, 0.0
        for i in sorted(probs, key=lambda t: -probs[t]):
            margin = min(margin, abs(mass - p.top_p))
            if mass >= p.top_p:  # the smallest prefix reaching top_p is complete
                break
            kept[i] = x[i]
            mass += probs[i]
        x = kept
    if p.min_p > 0.0:
        probs = _softmax(x)
        top = max(probs.values())
        margin = min(margin, min(abs(q / top - p.min_p) for q in probs.values()))
        x = {i: v for i, v in x.items() if probs[i] >= p.min_p * top}
    return x, margin


def ref_log_softmax(row: list[float]) -> list[float]:
    m = max(row)
    lse = m + math.log(sum(math.exp(v - m) for v in row))
    return [v - lse for v in row]


# ----------------------------------------------------------------------------- helpers


def make_batch(
    params: list[SamplingParams],
    vocab: int,
    device: str,
    prompts: list[list[int]] | None = None,
    outputs: list[list[int]] | None = None,
    generators: list[torch.Generator | None] | None = None,
    suppress: list[list[int]] | None = None,
) -> SamplingBatch:
    b = len(params)
    return SamplingBatch.build(
        params,
        prompts if prompts is not None else [[] for _ in range(b)],
        outputs if outputs is not None else [[] for _ in range(b)],
        generators if generators is not None else [None] * b,
        suppress,
        vocab,
        device,
    )


def random_filter_params(rng: random.Random) -> SamplingParams:
    return SamplingParams(
        temperature=rng.choice([0.3, 0.7, 1.0, 1.8]),
        top_k=rng.choice([0, -1, 1, 2, 5, 17, 64, 1000]),
        top_p=rng.choice([1.0, 1.0, 0.2, 0.5, 0.8, 0.95]),
        min_p=rng.choice([0.0, 0.0, 0.02, 0.1, 0.5]),
    )


# ----------------------------------------------------------------------------- build


def test_build_neutral_knobs_are_none_and_counts_match() -> None:
    plain = [SamplingParams(), SamplingParams(temperature=0.0)]
    b = make_batch(plain, 10, "cpu")
    assert b.top_k is b.top_p is b.min_p is None
    assert b.presence_penalty is b.frequency_penalty is b.repetition_penalty is None
    assert b.output_token_counts is b.prompt_or_output_mask is b.suppress_mask is None
    assert b.max_num_logprobs is None and not b.all_greedy
    assert b.temperature.tolist() == [1.0, 0.0]

    params = [SamplingParams(frequency_penalty=0.5, logprobs=2), SamplingParams(temperature=0, logprobs=0)]
    prompts, outputs = [[1, 2, 2], [9]], [[3, 3, 3, 1], []]
    b = make_batch(params, 10, "cpu", prompts, outputs, suppress=[[], [4, 5]])
    assert b.max_num_logprobs == 2
    assert b.presence_penalty is None and b.frequency_penalty is not None
    assert b.output_token_counts is not None and b.suppress_mask is not None
    for r in range(2):
        c = Counter(outputs[r])
        assert b.output_token_counts[r].tolist() == [c.get(t, 0) for t in range(10)]
    assert b.suppress_mask.nonzero().tolist() == [[1, 4], [1, 5]]
    assert make_batch([SamplingParams(temperature=0)] * 3, 10, "cpu").all_greedy

    b = make_batch([SamplingParams(repetition_penalty=1.2)] * 2, 10, "cpu", prompts, outputs)
    assert b.prompt_or_output_mask is not None
    for r in range(2):
        seen = set(prompts[r]) | set(outputs[r])
        assert b.prompt_or_output_mask[r].tolist() == [t in seen for t in range(10)]


# ----------------------------------------------------------------------------- (b) greedy


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_all_greedy_is_argmax(device: str, dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    logits = (torch.randn(32, 300) * 4).to(device=device, dtype=dtype)
    logits[0, 5] = logits[0, 200] = 100.0  # a tie: the first maximum wins, as in float32
    # Greedy ignores top-k/top-p/min-p entirely.
    params = [SamplingParams(temperature=0.0, top_k=3, top_p=0.1, min_p=0.9)] * 32
    out = Sampler()(logits, make_batch(params, 300, device))
    assert out.sampled_token_ids.dtype == torch.int64
    assert out.sampled_token_ids.tolist() == logits.float().argmax(-1).tolist()
    assert out.sampled_token_ids[0] == 5
    assert out.sampled_logprobs is None and out.top_logprobs is None and out.top_token_ids is None


@pytest.mark.parametrize("device", DEVICES)
def test_greedy_rows_in_mixed_batch_take_argmax_of_penalised(device: str) -> None:
    rng = random.Random(1)
    torch.manual_seed(1)
    b, v = 12, 50
    logits = torch.randn(b, v) * 3
    params, prompts, outputs = [], [], []
    for i in range(b):
        params.append(
            SamplingParams(
                temperature=0.0 if i % 2 == 0 else 1.0,
                repetition_penalty=rng.choice([1.0, 1.5, 3.0]),
                frequency_penalty=rng.uniform(-2, 2),
                presence_penalty=rng.uniform(-2, 2),
                top_k=rng.choice([0, 2]),
            )
        )
        prompts.append([rng.randrange(v) for _ in range(rng.randrange(8))])
        outputs.append([rng.randrange(v) for _ in range(rng.randrange(8))])
    batch = make_batch(params, v, device, prompts, outputs)
    out = Sampler()(logits.to(device), batch)
    for i in range(0, b, 2):
        ref = ref_penalties(logits[i].tolist(), params[i], prompts[i], outputs[i], [])
        assert out.sampled_token_ids[i].item() == max(range(v), key=lambda t: ref[t])


# ----------------------------------------------------------------------------- (c) filters


@pytest.mark.parametrize("device", DEVICES)
def test_apply_filters_matches_naive_reference(device: str) -> None:
    rng = random.Random(2)
    gen = torch.Generator().manual_seed(2)
    checked = skipped = 0
    for _ in range(25):
        b, v = 16, rng.choice([8, 64, 200])
        logits = torch.randn(b, v, generator=gen) * rng.choice([0.5, 2.0, 5.0])
        params = [random_filter_params(rng) for _ in range(b)]
        got = apply_filters(logits.to(device), make_batch(params, v, device)).cpu()
        for i in range(b):
            want, margin = ref_filter(logits[i].tolist(), params[i])
            if margin < MARGIN:
                skipped += 1
                continue
            checked += 1
            kept = set(torch.isfinite(got[i]).nonzero().flatten().tolist())
            assert kept == set(want), (params[i], sorted(kept), sorted(want))
            for t, val in want.items():
                assert got[i, t].item() == pytest.approx(val, rel=1e-5, abs=1e-5)
    assert skipped <= checked // 20


@pytest.mark.parametrize("device", DEVICES)
def test_sampled_tokens_stay_inside_the_filtered_set(device: str) -> None:
    rng = random.Random(3)
    gen = torch.Generator().manual_seed(3)
    b, v = 16, 40
    logits = torch.randn(b, v, generator=gen) * 2
    params = [random_filter_params(rng) for _ in range(b)]
    allowed = [set(ref_filter(logits[i].tolist(), params[i])[0]) for i in range(b)]
    # Each row repeated `reps` times in one batch: many draws per forward call.
    reps = 50
    batch = make_batch([p for p in params for _ in range(reps)], v, device)
    dev_logits = logits.repeat_interleave(reps, dim=0).to(device)
    sampler = Sampler()
    torch.manual_seed(3)
    seen: list[set[int]] = [set() for _ in range(b)]
    for _ in range(6):
        for j, t in enumerate(sampler(dev_logits, batch).sampled_token_ids.tolist()):
            seen[j // reps].add(t)
    for i in range(b):
        assert seen[i] <= allowed[i], (params[i], seen[i] - allowed[i])
        if len(allowed[i]) == 1:
            assert seen[i] == allowed[i]


def test_top_k_larger_than_vocab_and_top_p_one_keep_everything() -> None:
    logits = torch.randn(3, 7)
    params = [SamplingParams(top_k=100), SamplingParams(top_k=7, top_p=1.0), SamplingParams(top_p=0.999999)]
    got = apply_filters(logits, make_batch(params, 7, "cpu"))
    assert torch.isfinite(got[:2]).all()
    assert torch.equal(got[:2], logits[:2])


# ----------------------------------------------------------------------------- (d) penalties


@pytest.mark.parametrize("device", DEVICES)
def test_apply_penalties_matches_naive_reference(device: str) -> None:
    rng = random.Random(4)
    gen = torch.Generator().manual_seed(4)
    for _ in range(10):
        b, v = 8, 30
        logits = torch.randn(b, v, generator=gen) * 3
        params, prompts, outputs, suppress = [], [], [], []
        for _ in range(b):
            params.append(
                SamplingParams(
                    repetition_penalty=rng.choice([1.0, 0.7, 1.3, 2.0]),
                    frequency_penalty=rng.choice([0.0, rng.uniform(-2, 2)]),
                    presence_penalty=rng.choice([0.0, rng.uniform(-2, 2)]),
                )
            )
            # Few distinct ids, so repeats (counts > 1) and prompt/output overlap are common.
            prompts.append([rng.randrange(v // 2) for _ in range(rng.randrange(12))])
            outputs.append([rng.randrange(v // 2) for _ in range(rng.randrange(12))])
            suppress.append(rng.sample(range(v), rng.choice([0, 0, 1, 3])))
        batch = make_batch(params, v, device, prompts, outputs, suppress=suppress)
        before = logits.clone()
        got = apply_penalties(logits.to(device), batch).cpu()
        assert torch.equal(logits, before)  # input untouched
        for i in range(b):
            want = ref_penalties(logits[i].tolist(), params[i], prompts[i], outputs[i], suppress[i])
            for t in range(v):
                if want[t] == NEG_INF:
                    assert got[i, t].item() == NEG_INF
                else:
                    assert got[i, t].item() == pytest.approx(want[t], rel=1e-5, abs=1e-5)


def test_penalty_semantics_spot_values() -> None:
    # Hand-computed: token 0 (+2, in prompt) -> 2/2; token 1 (-2, in output twice) -> -2*2 - 0.5*2 - 1.
    logits = torch.tensor([[2.0, -2.0, 1.0, -1.0]])
    p = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=1.0)
    got = apply_penalties(logits, make_batch([p], 4, "cpu", [[0]], [[1, 1]], suppress=[[3]]))
    assert got.tolist() == [[1.0, -6.0, 1.0, NEG_INF]]


# ----------------------------------------------------------------------------- (e) seeds


def _seeded_run(seed: int, companions: int, position: int, steps: int = 6) -> list[int]:
    """Tokens a seeded row (uniform-ish over 500 ids) draws over `steps` steps among random rows."""
    v = 500
    target = torch.randn(v, generator=torch.Generator().manual_seed(99)) * 0.3
    g = torch.Generator().manual_seed(seed)
    sampler = Sampler()
    tokens = []
    for step in range(steps):
        others = torch.randn(companions, v, generator=torch.Generator().manual_seed(1000 + step))
        rows = list(others)
        rows.insert(position, target)
        params = [SamplingParams(temperature=0.9, top_k=50, top_p=0.8, presence_penalty=1.0)] * companions
        params.insert(position, SamplingParams(temperature=1.0, seed=seed))
        gens: list[torch.Generator | None] = [None] * companions
        gens.insert(position, g)
        outs: list[list[int]] = [[step, 1, 2]] * companions
        outs.insert(position, [])
        batch = make_batch(params, v, "cpu", outputs=outs, generators=gens)
        torch.manual_seed(7 * step + companions)  # companions' default-RNG draws differ per run
        tokens.append(sampler(torch.stack(rows), batch).sampled_token_ids[position].item())
    return tokens


def test_seeded_row_is_reproducible_and_batch_independent() -> None:
    alone = _seeded_run(42, companions=0, position=0)
    assert _seeded_run(42, companions=0, position=0) == alone
    assert _seeded_run(42, companions=3, position=3) == alone
    assert _seeded_run(42, companions=7, position=2) == alone
    assert _seeded_run(43, companions=0, position=0) != alone


def test_unseeded_rows_use_the_default_rng() -> None:
    logits = torch.zeros(64, 1000)
    batch = make_batch([SamplingParams()] * 64, 1000, "cpu")
    torch.manual_seed(5)
    a = Sampler()(logits, batch).sampled_token_ids
    torch.manual_seed(5)
    b = Sampler()(logits, batch).sampled_token_ids
    c = Sampler()(logits, batch).sampled_token_ids
    assert torch.equal(a, b) and not torch.equal(a, c)


# ----------------------------------------------------------------------------- (f) distribution


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.8),
        SamplingParams(temperature=1.5, top_k=3),
        SamplingParams(temperature=1.0, top_p=0.7),
        SamplingParams(temperature=1.2, min_p=0.3),
    ],
    ids=["temperature", "top_k", "top_p", "min_p"],
)
@pytest.mark.parametrize("device", DEVICES)
def test_empirical_distribution_matches_reference(params: SamplingParams, device: str) -> None:
    row = [1.0, 0.5, -0.3, 2.0, 0.0]
    kept, margin = ref_filter(row, params)
    assert margin > 1e-3
    probs = _softmax(kept)
    expected = [probs.get(t, 0.0) for t in range(5)]
    n = 20000
    torch.manual_seed(11)
    batch = make_batch([params] * n, 5, device)
    ids = Sampler()(torch.tensor([row] * n, device=device), batch).sampled_token_ids.cpu()
    freq = torch.bincount(ids, minlength=5).double() / n
    assert max(abs(f - e) for f, e in zip(freq.tolist(), expected)) < 0.015
    chi2 = sum((f * n - e * n) ** 2 / (e * n) for f, e in zip(freq.tolist(), expected) if e > 0)
    assert chi2 < 20.5  # chi-square, df <= 4, p ~ 0.0004
    for t in range(5):
        if expected[t] == 0.0:
            assert freq[t] == 0.0


def test_seeded_generator_draws_follow_the_distribution() -> None:
    row = torch.tensor([[0.0, 1.0, -1.0, 0.5]])
    expected = torch.softmax(row[0].double(), -1)
    g = torch.Generator().manual_seed(123)
    batch = make_batch([SamplingParams(seed=123)], 4, "cpu", generators=[g])
    sampler = Sampler()
    n = 3000
    ids = torch.tensor([sampler(row, batch).sampled_token_ids.item() for _ in range(n)])
    freq = torch.bincount(ids, minlength=4).double() / n
    assert (freq - expected).abs().max().item() < 0.035


# ----------------------------------------------------------------------------- (g) logprobs


@pytest.mark.parametrize("device", DEVICES)
def test_logprobs_are_raw_log_softmax_and_top_ids_sorted(device: str) -> None:
    torch.manual_seed(6)
    b, v = 6, 80
    logits = torch.randn(b, v) * 3
    params = [
        SamplingParams(logprobs=None, temperature=0.5, repetition_penalty=1.5),
        SamplingParams(logprobs=0, temperature=0.0, frequency_penalty=1.0),
        SamplingParams(logprobs=3, top_k=4),
        SamplingParams(logprobs=5, temperature=2.0, top_p=0.5),
        SamplingParams(logprobs=1, min_p=0.2, presence_penalty=2.0),
        SamplingParams(logprobs=5),
    ]
    outputs = [[0, 1, 2], [3, 3], [], [4], [5, 6, 6], []]
    batch = make_batch(params, v, device, [[7, 8]] * b, outputs)
    assert batch.max_num_logprobs == 5
    out: SamplerOutput = Sampler()(logits.to(device), batch)
    assert out.sampled_logprobs is not None and out.top_logprobs is not None and out.top_token_ids is not None
    assert out.top_logprobs.shape == (b, 5) and out.top_token_ids.shape == (b, 5)
    assert out.top_token_ids.dtype == torch.int64 and out.sampled_logprobs.dtype == torch.float32
    for i in range(b):
        row = logits[i].tolist()
        ref = ref_log_softmax(row)
        tok = out.sampled_token_ids[i].item()
        assert out.sampled_logprobs[i].item() == pytest.approx(ref[tok], abs=1e-4)
        want_ids = sorted(range(v), key=lambda t: -row[t])[:5]
        assert out.top_token_ids[i].tolist() == want_ids
        assert out.top_logprobs[i].tolist() == pytest.approx([ref[t] for t in want_ids], abs=1e-4)


def test_logprobs_zero_gives_sampled_only() -> None:
    logits = torch.randn(2, 10, dtype=torch.bfloat16)
    out = Sampler()(logits, make_batch([SamplingParams(logprobs=0)] * 2, 10, "cpu"))
    assert out.top_logprobs is not None and out.top_logprobs.shape == (2, 0)
    assert out.top_token_ids is not None and out.top_token_ids.shape == (2, 0)
    assert out.sampled_logprobs is not None and out.sampled_logprobs.shape == (2,)
    assert out.sampled_logprobs.dtype == torch.float32


# ----------------------------------------------------------------------------- (h) suppression


@pytest.mark.parametrize("device", DEVICES)
def test_suppressed_tokens_are_never_sampled(device: str) -> None:
    b, v = 64, 12
    logits = torch.zeros(b, v)
    logits[:, 0] = 10.0  # e.g. EOS: by far the most likely token, yet blocked
    logits[:, 3] = 9.0
    params = [SamplingParams(temperature=0.0 if i < 2 else 1.5, min_tokens=1) for i in range(b)]
    gens: list[torch.Generator | None] = [None] * b
    gens[5] = torch.Generator(device=device).manual_seed(1)
    batch = make_batch(params, v, device, generators=gens, suppress=[[0, 3]] * b)
    sampler = Sampler()
    torch.manual_seed(8)
    seen: set[int] = set()
    for _ in range(20):
        seen |= set(sampler(logits.to(device), batch).sampled_token_ids.tolist())
    assert not seen & {0, 3}
    assert len(seen) > 5  # the remaining flat tokens are all reachable


# ----------------------------------------------------------------------------- float32 extremes


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=FLOAT32_MAX),
        SamplingParams(repetition_penalty=FLOAT32_TINY),  # 5 / 1.2e-38 overflows float32
        SamplingParams(repetition_penalty=FLOAT32_MAX),  # -1 * 3.4e38 ... every allowed token at -inf
        SamplingParams(repetition_penalty=FLOAT32_TINY, temperature=1e-5),
        SamplingParams(repetition_penalty=FLOAT32_MAX, temperature=FLOAT32_MAX),
    ],
)
def test_extreme_knobs_stay_inside_a_grammar_mask(params: SamplingParams, device: str) -> None:
    # The largest and smallest values SamplingParams accepts: the sampled token stays among those a
    # grammar allows (logits -inf elsewhere) and no NaN reaches the softmax.
    vocab, allowed = 16, [3, 7]
    logits = torch.full((4, vocab), NEG_INF, device=device)
    logits[:, 3], logits[:, 7] = 5.0, -1.0
    batch = make_batch([params] * 4, vocab, device, prompts=[[0, 3, 7, 9]] * 4, outputs=[[3]] * 4)
    assert torch.isfinite(apply_filters(apply_penalties(logits, batch), batch)[:, allowed]).all()
    for _ in range(5):
        out = Sampler()(logits, batch)
        assert set(out.sampled_token_ids.tolist()) <= set(allowed)


def test_logprob_token_ids_give_those_tokens_raw_logprobs() -> None:
    torch.manual_seed(8)
    b, v = 3, 50
    logits = torch.randn(b, v) * 3
    params = [
        SamplingParams(logprob_token_ids=[7, 3, 49], temperature=0.7, repetition_penalty=1.4),
        SamplingParams(logprobs=2),  # no ids of its own: its padding row is not read
        SamplingParams(logprob_token_ids=[0], logprobs=4),
    ]
    assert params[0].logprobs == 0  # implied
    batch = make_batch(params, v, "cpu", [[7, 8]] * b)
    assert batch.logprob_token_ids is not None
    assert batch.logprob_token_ids.tolist() == [[7, 3, 49], [0, 0, 0], [0, 0, 0]]
    out = Sampler()(logits, batch)
    assert out.chosen_logprobs is not None
    for i, ids in ((0, [7, 3, 49]), (2, [0])):
        ref = ref_log_softmax(logits[i].tolist())
        assert out.chosen_logprobs[i, : len(ids)].tolist() == pytest.approx([ref[t] for t in ids], abs=1e-4)
    assert Sampler()(logits, make_batch([SamplingParams(logprobs=1)] * b, v, "cpu")).chosen_logprobs is None
