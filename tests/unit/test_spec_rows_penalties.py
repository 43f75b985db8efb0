"""Verifying proposals of penalised requests (`worker/spec_rows.py`) against decoding one token at a time:
at every position the penalties see the proposals before it, and the accepted ones join the histories
`SamplingState` keeps for later steps."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagoda.layers.sampler import Sampler, SamplingBatch, SamplingState, apply_penalties
from pagoda.sampling_params import SamplingParams
from pagoda.worker.spec_rows import sample
from pagoda.worker.step_inputs import SpecRows

VOCAB = 12
PENALTIES = [
    {"repetition_penalty": 2.5},
    {"frequency_penalty": 1.5, "presence_penalty": 0.8},
    {"repetition_penalty": 1.7, "frequency_penalty": 0.9},
    {},
]


def one_token(logits: torch.Tensor, params: SamplingParams, prompt: list[int], output: list[int]) -> int:
    """The reference: the greedy token after `output`, penalised with exactly that history."""
    batch = SamplingBatch.build([params], [prompt], [output], [None], None, VOCAB, "cpu")
    return int(apply_penalties(logits[None], batch).argmax())


@pytest.mark.parametrize("seed", range(8))
def test_penalised_rows_verify_as_one_token_at_a_time(seed):
    gen = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    k = 4
    state, ids, rows = SamplingState(capacity=4, vocab_size=VOCAB, device="cpu"), [], []
    logits_rows, proposals, want = [], [], []
    for i, knobs in enumerate(PENALTIES):
        params = SamplingParams(temperature=0, **knobs)
        prompt = rng.integers(0, VOCAB, size=5).tolist()
        output = rng.integers(0, VOCAB, size=3).tolist()
        state.add(f"r{i}", params, prompt, output)
        ids.append(f"r{i}")
        logits = torch.randn(k + 1, VOCAB, generator=gen)
        # The chain decoding one token at a time would produce; the proposals follow it, then (for some
        # rows) go wrong at a random place.
        chain: list[int] = []
        for j in range(k + 1):
            chain.append(one_token(logits[j], params, prompt, output + chain))
        d = int(rng.integers(1, k + 1))
        mine = chain[:d]
        wrong = int(rng.integers(0, d + 1))  # == d: every proposal holds
        if wrong < d:
            mine[wrong] = (mine[wrong] + 1) % VOCAB
        held = wrong if wrong < d else d
        proposals.append(mine)
        want.append(chain[: held + 1])
        logits_rows.append(logits[: d + 1])
        rows.append((params, prompt, output))
    counts = np.array([len(p) for p in proposals])
    penalized, no_logprobs = np.array([bool(p) for p in PENALTIES]), np.full(len(ids), -1)
    spec = SpecRows(counts, proposals, np.ones(len(ids), dtype=bool), penalized, no_logprobs)
    out, verified = sample(Sampler(), state, torch.cat(logits_rows), ids, spec, None)
    got = [verified.tokens[r, : int(verified.counts[r])].tolist() for r in range(len(ids))]
    assert got == want
    assert out.sampled_token_ids.tolist() == [w[-1] for w in want]
    # The histories later steps see: every token of this step, the accepted proposals included.
    state.update(out.sampled_token_ids, verified.earlier)
    after = state.batch(ids)
    full = [output + w for (_, _, output), w in zip(rows, want)]
    rebuilt = SamplingBatch.build(
        [p for p, _, _ in rows], [pr for _, pr, _ in rows], full, [None] * len(ids), None, VOCAB, "cpu"
    )
    # (A row's mask or counts are kept only while its own penalty reads them.)
    counted = [r for r, p in enumerate(PENALTIES) if "frequency_penalty" in p or "presence_penalty" in p]
    assert torch.equal(after.output_token_counts[counted], rebuilt.output_token_counts[counted])
    seen = [r for r, p in enumerate(PENALTIES) if "repetition_penalty" in p]
    assert torch.equal(after.prompt_or_output_mask[seen], rebuilt.prompt_or_output_mask[seen])


@pytest.mark.parametrize("equal_counts", [True, False])
@pytest.mark.parametrize("seed", range(4))
def test_greedy_rows_verify_the_same_through_the_lean_path(seed, equal_counts, monkeypatch):
    """Greedy proposal rows without penalties, grammars or logprobs take `_sample_greedy`; its tokens are greedy
    decoding's one at a time (the argmax chain) and the general path's, with equal and unequal proposal counts."""
    from pagoda.worker import spec_rows

    gen = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    k, rows = 4, 6
    logits_rows, proposals, want = [], [], []
    for _ in range(rows):
        d = k if equal_counts else int(rng.integers(1, k + 1))
        logits = torch.randn(d + 1, VOCAB, generator=gen)
        chain = logits.argmax(dim=-1).tolist()  # greedy, no penalties: each position's argmax
        mine = chain[:d]
        wrong = int(rng.integers(0, d + 1))
        if wrong < d:
            mine[wrong] = (mine[wrong] + 1) % VOCAB
        proposals.append(mine)
        want.append(chain[: (wrong if wrong < d else d) + 1])
        logits_rows.append(logits)
    ids = [f"r{i}" for i in range(rows)]
    spec = SpecRows(
        np.array([len(p) for p in proposals]), proposals, np.ones(rows, bool), np.zeros(rows, bool), np.full(rows, -1)
    )
    calls = []
    real = spec_rows._sample_greedy
    monkeypatch.setattr(spec_rows, "_sample_greedy", lambda *args: calls.append(1) or real(*args))
    results = {}
    for lean in (True, False):
        monkeypatch.setattr(spec_rows, "LEAN_GREEDY", lean)
        state = SamplingState(capacity=rows, vocab_size=VOCAB, device="cpu")
        for rid in ids:
            state.add(rid, SamplingParams(temperature=0), [1, 2], [])
        out, verified = sample(Sampler(), state, torch.cat(logits_rows), ids, spec, None)
        got = [verified.tokens[r, : int(verified.counts[r])].tolist() for r in range(rows)]
        assert got == want
        assert out.sampled_token_ids.tolist() == [w[-1] for w in want]
        results[lean] = verified
    assert len(calls) == 1  # the lean side only
    assert torch.equal(results[True].tokens, results[False].tokens)
    assert torch.equal(results[True].counts, results[False].counts)
