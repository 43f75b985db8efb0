"""The one-launch greedy verification (`pagoda/kernels/spec_verify.py`) against the PyTorch reference
(`pagoda.spec_decode.rejection.verify_greedy`, with each row's proposal count) on random cases built so every
number of kept proposals occurs: rows with none, some and all of their proposals right, and rows with fewer
proposals than the widest (-1 padding)."""

from __future__ import annotations

import pytest
import torch

from pagoda.kernels import spec_verify
from pagoda.spec_decode.rejection import verify_greedy as verify_reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _case(rows: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    target = torch.randint(0, 50, (rows, k + 1), generator=g)
    counts = torch.randint(0, k + 1, (rows,), generator=g)
    right = torch.randint(0, k + 1, (rows,), generator=g)  # proposals right before the first wrong one
    drafts = torch.full((rows, k), -1, dtype=torch.int64)
    for r in range(rows):
        n = int(counts[r])
        drafts[r, :n] = target[r, :n]
        if right[r] < n:  # a wrong proposal at `right`, anything after it
            drafts[r, right[r]] = (target[r, right[r]] + 1) % 50
            drafts[r, right[r] + 1 : n] = torch.randint(0, 50, (n - int(right[r]) - 1,), generator=g)
    return target.to(DEVICE), drafts.to(DEVICE), counts.to(DEVICE)


@pytest.mark.parametrize("rows,k", [(1, 1), (1, 8), (5, 3), (16, 4), (33, 7)])
def test_kernel_matches_reference(rows, k):
    for seed in range(3):
        target, drafts, counts = _case(rows, k, seed)
        tokens, num, last = spec_verify.verify_greedy(target, drafts)
        ref_tokens, ref_num = verify_reference(target, drafts, counts)
        assert torch.equal(tokens, ref_tokens)
        assert torch.equal(num, ref_num)
        assert torch.equal(last, ref_tokens.gather(1, (ref_num - 1)[:, None]).squeeze(1))
        # Every row keeps its own token and at most all its proposals (the reference equality above is the check).
        assert num.min() >= 1 and num.max() <= k + 1


def test_all_and_none_kept():
    target = torch.tensor([[3, 4, 5, 6], [3, 4, 5, 6]], device=DEVICE)
    drafts = torch.tensor([[3, 4, 5], [9, 4, 5]], device=DEVICE)
    tokens, num, last = spec_verify.verify_greedy(target, drafts)
    assert tokens.tolist() == [[3, 4, 5, 6], [3, -1, -1, -1]]
    assert num.tolist() == [4, 1] and last.tolist() == [6, 3]


def test_shapes_are_checked():
    with pytest.raises(ValueError, match="verify_greedy"):
        spec_verify.verify_greedy(torch.zeros(2, 3, dtype=torch.int64), torch.zeros(2, 3, dtype=torch.int64))


@pytest.mark.parametrize("equal_counts", [True, False])
def test_lean_greedy_sampling_through_the_kernel(equal_counts, monkeypatch):
    """`spec_rows.sample` on greedy proposal rows (the lean path) gives the same rows' tokens, counts and last
    tokens with the kernel as with the PyTorch reference, with equal and unequal proposal counts."""
    import numpy as np

    from pagoda.layers.sampler import Sampler, SamplingState
    from pagoda.sampling_params import SamplingParams
    from pagoda.worker import spec_rows
    from pagoda.worker.step_inputs import SpecRows

    vocab, k, rows = 20, 4, 5
    g = torch.Generator().manual_seed(7)
    rng = np.random.default_rng(7)
    counts = np.full(rows, k) if equal_counts else rng.integers(1, k + 1, rows)
    logits = torch.randn(int((counts + 1).sum()), vocab, generator=g, device="cpu").to(DEVICE)
    chain = logits.argmax(dim=-1).tolist()
    proposals, at = [], 0
    for r in range(rows):
        mine = chain[at : at + int(counts[r])]
        if r % 2:  # odd rows: a wrong proposal somewhere
            j = int(rng.integers(0, len(mine)))
            mine[j] = (mine[j] + 1) % vocab
        proposals.append(mine)
        at += int(counts[r]) + 1
    spec = SpecRows(counts, proposals, np.ones(rows, bool), np.zeros(rows, bool), np.full(rows, -1))
    ids = [f"r{i}" for i in range(rows)]
    results = []
    for kernel in (spec_verify, None):
        monkeypatch.setattr(spec_rows.dispatch, "spec_verify_for", lambda x, m=kernel: m)
        state = SamplingState(capacity=rows, vocab_size=vocab, device=DEVICE)
        for rid in ids:
            state.add(rid, SamplingParams(temperature=0), [1, 2], [])
        out, verified = spec_rows.sample(Sampler(), state, logits, ids, spec, None)
        results.append((out.sampled_token_ids, verified.tokens, verified.counts))
    for got, ref in zip(*results):
        assert torch.equal(got, ref)
    assert results[0][2].min() >= 1 and results[0][2].max() == k + 1  # some rows kept every proposal
