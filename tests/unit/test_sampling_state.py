"""`SamplingState` (persistent per-request sampling rows) against `SamplingBatch.build` (rebuilt from
the full histories every step): over random request lifetimes (adds, removals, rows that skip a
step, rows in shuffled order, growth past the initial capacity) every batch must give bit-identical
penalised logits, filters, logprobs and sampled tokens, seeded rows included."""

from __future__ import annotations

import random

import pytest
import torch

from pagoda.layers.sampler import Sampler, SamplingBatch, SamplingState, apply_filters, apply_penalties
from pagoda.sampling_params import SamplingParams

VOCAB = 40
EOS = [2, 3]


def random_params(rng: random.Random, index: int) -> SamplingParams:
    kind = rng.choice(["greedy", "sampled", "rep", "freq", "mixed", "min_tokens", "seeded", "logprobs", "chosen"])
    kw: dict = {}
    if kind == "greedy":
        kw = dict(temperature=0.0)
    elif kind == "sampled":
        kw = dict(temperature=0.8, top_p=0.95)
    elif kind == "rep":
        kw = dict(temperature=rng.choice([0.0, 0.7]), repetition_penalty=rng.choice([1.05, 0.8, 1.5]))
    elif kind == "freq":
        kw = dict(temperature=0.9, frequency_penalty=rng.choice([0.5, -0.4]), presence_penalty=rng.choice([0.0, 0.3]))
    elif kind == "mixed":
        kw = dict(
            temperature=1.2,
            top_k=rng.choice([0, 3, 100]),
            min_p=rng.choice([0.0, 0.05]),
            repetition_penalty=1.1,
            presence_penalty=0.2,
        )
    elif kind == "min_tokens":
        kw = dict(temperature=0.0, min_tokens=rng.randint(1, 4), stop_token_ids=rng.choice([[], [7], [7, 9]]))
    elif kind == "seeded":
        kw = dict(temperature=1.0, seed=1000 + index)
    elif kind == "chosen":
        kw = dict(temperature=0.5, logprob_token_ids=rng.choice([[5], [1, 9, 30], [39, 0]]))
    else:
        kw = dict(temperature=0.0, logprobs=rng.choice([0, 3]))
    return SamplingParams(max_tokens=100, **kw)


def assert_same(a: torch.Tensor | None, b: torch.Tensor | None, rows: list[int] | None = None) -> None:
    assert (a is None) == (b is None)
    if a is not None:
        if rows is not None:
            a, b = a[rows], b[rows]
        assert torch.equal(a, b)


@pytest.mark.parametrize("seed", range(6))
def test_state_batches_equal_rebuilt_batches(seed: int) -> None:
    rng = random.Random(seed)
    state = SamplingState(capacity=3, vocab_size=VOCAB, device="cpu", eos_token_ids=EOS)
    live: dict[str, dict] = {}
    sampler = Sampler()
    next_id = 0
    for step in range(60):
        for _ in range(rng.choice([0, 0, 1, 2, 3])):  # arrivals
            rid = f"r{next_id}"
            params = random_params(rng, next_id)
            next_id += 1
            prompt = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 12))]
            gens = [None, None]
            if params.seed is not None:
                gens = [torch.Generator().manual_seed(params.seed), torch.Generator().manual_seed(params.seed)]
            live[rid] = dict(params=params, prompt=prompt, output=[], gens=gens)
            state.add(rid, params, prompt, generator=gens[0])
        for rid in [r for r in live if rng.random() < 0.08]:  # finished / aborted
            state.remove(rid)
            del live[rid]
        # Rows that sample this step: a shuffled subset (others are preempted or mid-prefill).
        rows = [r for r in live if rng.random() < 0.85]
        rng.shuffle(rows)
        if not rows:
            continue
        reqs = [live[r] for r in rows]
        got = state.batch(rows)
        want = SamplingBatch.build(
            [q["params"] for q in reqs],
            [q["prompt"] for q in reqs],
            [q["output"] for q in reqs],
            [q["gens"][1] for q in reqs],
            [EOS + q["params"].stop_token_ids if len(q["output"]) < q["params"].min_tokens else [] for q in reqs],
            VOCAB,
            "cpu",
        )
        for name in (
            "temperature",
            "top_k",
            "top_p",
            "min_p",
            "presence_penalty",
            "frequency_penalty",
            "repetition_penalty",
            "suppress_mask",
            "logprob_token_ids",
        ):
            assert_same(getattr(got, name), getattr(want, name))
        assert got.max_num_logprobs == want.max_num_logprobs and got.all_greedy == want.all_greedy
        assert all(g is q["gens"][0] for g, q in zip(got.generators, reqs))
        # Histories matter only where the knob is not neutral; elsewhere the state may hold anything.
        rep_rows = [i for i, q in enumerate(reqs) if q["params"].repetition_penalty != 1.0]
        count_rows = [
            i for i, q in enumerate(reqs) if q["params"].frequency_penalty != 0.0 or q["params"].presence_penalty != 0.0
        ]
        assert_same(got.prompt_or_output_mask, want.prompt_or_output_mask, rep_rows)
        assert_same(got.output_token_counts, want.output_token_counts, count_rows)

        logits = torch.randn(len(rows), VOCAB, generator=torch.Generator().manual_seed(step)) * 3
        assert torch.equal(apply_penalties(logits, got), apply_penalties(logits, want))
        if not want.all_greedy:
            assert torch.equal(
                apply_filters(apply_penalties(logits, got), got), apply_filters(apply_penalties(logits, want), want)
            )
        state.generator.manual_seed(step)  # the state's own unseeded generator, as every batch it makes
        out_got = sampler(logits, got)
        want.unseeded = torch.Generator().manual_seed(step)
        out_want = sampler(logits, want)
        assert torch.equal(out_got.sampled_token_ids, out_want.sampled_token_ids)
        assert_same(out_got.top_logprobs, out_want.top_logprobs)
        assert_same(out_got.chosen_logprobs, out_want.chosen_logprobs)
        state.update(out_got.sampled_token_ids)
        for q, token in zip(reqs, out_got.sampled_token_ids.tolist()):
            q["output"].append(token)
    assert len(state) == len(live) and state.capacity > 3, "the run was meant to grow the state"


def test_add_with_existing_output_and_row_reuse() -> None:
    state = SamplingState(capacity=1, vocab_size=10, device="cpu")
    rep = SamplingParams(repetition_penalty=1.3, frequency_penalty=0.5)
    state.add("a", rep, [1, 2], output_token_ids=[4, 4, 5])
    b = state.batch(["a"])
    assert b.prompt_or_output_mask[0].nonzero().flatten().tolist() == [1, 2, 4, 5]
    assert b.output_token_counts[0].tolist() == [0, 0, 0, 0, 2, 1, 0, 0, 0, 0]
    state.update(torch.tensor([6]))
    state.remove("a")
    state.remove("never-added")  # ignored
    state.add("b", rep, [9])  # reuses a's row: nothing of a's history remains
    b = state.batch(["b"])
    assert b.prompt_or_output_mask[0].nonzero().flatten().tolist() == [9]
    assert not b.output_token_counts.any()
    with pytest.raises(AssertionError):
        state.add("b", rep, [9])


def test_plain_rows_need_no_vocab_sized_tensors() -> None:
    state = SamplingState(capacity=4, vocab_size=1000, device="cpu")
    for i in range(4):
        state.add(str(i), SamplingParams(temperature=0.8 if i % 2 else 0.0, top_p=0.9), [1, 2, 3])
    b = state.batch(["3", "0"])
    assert b.prompt_or_output_mask is None and b.output_token_counts is None and b.suppress_mask is None
    assert b.temperature.tolist() == pytest.approx([0.8, 0.0]) and not b.all_greedy
    state.update(torch.tensor([5, 6]))
    assert state._seen is None and state._counts is None


def test_temperature_only_fast_path_matches_build() -> None:
    """While no live row uses a knob other than temperature, batch() skips the knob table; a row
    that uses one (top_p here) switches back to the full path, and its removal back again."""
    state = SamplingState(capacity=4, vocab_size=30, device="cpu", eos_token_ids=EOS)
    plain = {
        "g": SamplingParams(temperature=0.0),
        "t": SamplingParams(temperature=0.6),
        "m": SamplingParams(temperature=0.0, min_tokens=2, max_tokens=10),
    }
    for rid, params in plain.items():
        state.add(rid, params, [1, 2])

    def check(rows: list[str], params: dict[str, SamplingParams], outputs: dict[str, int]) -> None:
        got = state.batch(rows)
        want = SamplingBatch.build(
            [params[r] for r in rows],
            [[1, 2]] * len(rows),
            [[0] * outputs.get(r, 0) for r in rows],
            [None] * len(rows),
            [EOS if outputs.get(r, 0) < params[r].min_tokens else [] for r in rows],
            30,
            "cpu",
        )
        for name in (
            "temperature",
            "top_k",
            "top_p",
            "min_p",
            "presence_penalty",
            "frequency_penalty",
            "repetition_penalty",
            "suppress_mask",
        ):
            assert_same(getattr(got, name), getattr(want, name))
        assert got.all_greedy == want.all_greedy and got.max_num_logprobs == want.max_num_logprobs
        state.update(torch.zeros(len(rows), dtype=torch.int64))
        for r in rows:
            outputs[r] = outputs.get(r, 0) + 1

    outputs: dict[str, int] = {}
    check(["m", "g"], plain, outputs)  # all greedy
    check(["t", "g", "m"], plain, outputs)
    state.add("p", SamplingParams(temperature=0.9, top_p=0.5), [3])
    both = plain | {"p": SamplingParams(temperature=0.9, top_p=0.5)}
    check(["g", "t"], both, outputs)  # a live row uses top_p: the full path
    check(["p", "m"], both, outputs)
    state.remove("p")
    check(["t", "m", "g"], plain, outputs)


def test_all_greedy_batches_copy_nothing_to_the_device(monkeypatch) -> None:
    """An all-greedy step (batch-1 serving) takes its zero temperatures from a cached device buffer,
    also past the buffer's first size; a step with a sampled row still copies its temperatures."""
    from pagoda.layers import sampler

    copies = []
    real = sampler.to_device
    monkeypatch.setattr(sampler, "to_device", lambda *a, **k: copies.append(a) or real(*a, **k))
    state = SamplingState(capacity=2, vocab_size=30, device="cpu")
    for i in range(6):
        state.add(f"g{i}", SamplingParams(temperature=0.0), [1])
    for rows in (["g0"], ["g3", "g1"], [f"g{i}" for i in range(6)]):
        b = state.batch(rows)
        assert b.all_greedy and b.temperature.tolist() == [0.0] * len(rows)
    assert not copies
    state.add("t", SamplingParams(temperature=0.7), [1])
    b = state.batch(["g0", "t"])
    assert not b.all_greedy and b.temperature.tolist() == pytest.approx([0.0, 0.7]) and copies


def test_unseeded_rows_draw_from_the_states_own_generator() -> None:
    """Unseeded rows sample from the state's generator, seeded with the engine's seed, and leave torch's default
    generator alone: on a GPU another thread may hold the default CUDA generator in a graph capture, where any
    draw from it on the engine's stream raises."""

    def draws(seed: int) -> list[int]:
        state = SamplingState(capacity=8, vocab_size=VOCAB, device="cpu", seed=seed)
        ids = [str(i) for i in range(8)]
        for rid in ids:
            state.add(rid, SamplingParams(temperature=1.0, top_k=20), [1, 2])
        logits = torch.zeros(8, VOCAB)  # uniform: every token equally likely, so the draws are all noise
        before = torch.get_rng_state()
        out = [Sampler()(logits, state.batch(ids)).sampled_token_ids.tolist() for _ in range(4)]
        assert torch.equal(torch.get_rng_state(), before), "unseeded sampling drew from torch's default generator"
        return sum(out, [])

    assert draws(7) == draws(7)
    assert draws(7) != draws(8)
