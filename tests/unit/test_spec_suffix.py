"""Suffix decoding proposals against a brute-force reference (loops over every position), the cache of
finished outputs (eviction, compaction, salts), and vLLM's suffix keys."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from pagoda.errors import ConfigError
from pagoda.spec_decode.config import parse_speculative_config
from pagoda.spec_decode.ngram import NgramProposer
from pagoda.spec_decode.suffix import OutputCache, SuffixParams, SuffixProposer


def naive_draft(corpus: list[int], pattern: list[int], k: int, p: SuffixParams, last: int, min_len: int) -> tuple:
    """Brute force: occurrences of the longest suffix of `pattern` (<= max_tree_depth) ending at a position
    < `last` of `corpus` (no -1 inside), then the most frequent continuation token by token."""
    n = len(corpus)
    best, occ = 0, []
    for length in range(min_len, min(p.max_tree_depth, len(pattern)) + 1):
        found = [
            e for e in range(length - 1, last) if corpus[e - length + 1 : e + 1] == pattern[len(pattern) - length :]
        ]
        if found:
            best, occ = length, found
    if not occ:
        return [], 0.0
    draft, prob, score = [], 1.0, 0.0
    while len(draft) < min(k, int(p.max_spec_factor * best)) and occ:
        nexts = Counter(corpus[e + 1] for e in occ if e + 1 < n and corpus[e + 1] != -1)
        if not nexts:
            break
        top = max(nexts.values())
        token = min(t for t, c in nexts.items() if c == top)  # ties: the smallest id
        prob *= top / len(occ)
        if prob < p.min_token_prob:
            break
        draft.append(token)
        score += prob
        occ = [e + 1 for e in occ if e + 1 < n and corpus[e + 1] == token]
    return draft, score


PARAMS = SuffixParams(max_tree_depth=6, max_cached_requests=4, max_spec_factor=1.5, min_token_prob=0.2)


@pytest.mark.parametrize("seed", range(6))
def test_own_tokens_propose_as_the_brute_force_search(seed):
    rng = np.random.default_rng(seed)
    proposer = SuffixProposer(5, PARAMS)
    for _ in range(150):
        # A small alphabet and repeated spans: many matches of many lengths.
        base = rng.integers(0, 4, size=int(rng.integers(2, 12))).tolist()
        tokens = (base * int(rng.integers(1, 4)) + rng.integers(0, 4, size=int(rng.integers(1, 30))).tolist())[:60]
        want, _ = naive_draft(tokens, tokens, 5, PARAMS, len(tokens) - 1, 1)
        assert proposer.propose(tokens, shared=False) == want, tokens


@pytest.mark.parametrize("seed", range(4))
def test_own_tokens_propose_as_the_brute_force_search_in_long_loops(seed):
    # What a model stuck in a loop produces: hundreds of occurrences, matches as deep as the search goes, and
    # continuations that agree for many tokens (taken as one unanimous run) before they split.
    rng = np.random.default_rng(seed)
    params = SuffixParams(max_tree_depth=12, max_cached_requests=0, max_spec_factor=2.0, min_token_prob=0.05)
    proposer = SuffixProposer(16, params)
    for _ in range(12):
        period = rng.integers(0, 4, size=int(rng.integers(1, 8))).tolist()
        noise = rng.integers(0, 4, size=int(rng.integers(0, 20))).tolist()
        tokens = (period * 200)[: int(rng.integers(40, 500))] + noise + period * int(rng.integers(0, 3))
        want, _ = naive_draft(tokens, tokens, 16, params, len(tokens) - 1, 1)
        assert proposer.propose(tokens, shared=False) == want, tokens


def test_the_most_frequent_continuation_wins_over_the_latest():
    # "1 2" was followed by 3 twice and by 9 once (the latest): n-gram lookup copies 9, suffix proposes 3.
    tokens = [1, 2, 3, 4, 1, 2, 3, 5, 1, 2, 9, 7, 1, 2]
    assert NgramProposer(4, 2, 8).propose(tokens) == [9, 7, 1, 2]
    sure = SuffixParams(max_tree_depth=8, max_cached_requests=0, max_spec_factor=2.0, min_token_prob=0.4)
    assert SuffixProposer(4, sure).propose(tokens) == [3]  # 3 at 2/3, then 4 or 5 at 2/3 x 1/2 < 0.4: stop
    bold = SuffixParams(max_tree_depth=8, max_cached_requests=0, max_spec_factor=2.0, min_token_prob=0.3)
    assert SuffixProposer(4, bold).propose(tokens) == [3, 4, 1, 2]  # the tie goes to the smaller id; 2 x 2 matched
    assert SuffixProposer(3, bold).propose(tokens) == [3, 4, 1]


def test_other_requests_outputs_are_searched_and_the_likelier_draft_is_proposed():
    params = SuffixParams(max_tree_depth=8, max_cached_requests=8, max_spec_factor=4.0, min_token_prob=0.1)
    proposer = SuffixProposer(6, params)
    answer = [50, 51, 52, 53, 54, 55, 56]
    proposer.finish("a", [10, 11, *answer, 12])
    proposer.finish("b", [20, *answer, 21])
    tokens = [1, 2, 3, 50, 51, 52]  # its own text has no earlier 52
    # Three matched (up to 4 x 3 proposals): the cached answer's rest, then 12 or 21 at one half each.
    assert proposer.propose(tokens) == [53, 54, 55, 56, 12]
    assert proposer.propose(tokens, shared=False) == []  # a salted request reads only its own tokens
    corpus = [10, 11, *answer, 12, -1, 20, *answer, 21, -1]
    assert proposer.propose(tokens) == naive_draft(corpus, tokens, 6, params, len(corpus), 2)[0]


@pytest.mark.parametrize("seed", range(4))
def test_cache_search_matches_the_brute_force_through_evictions_and_compactions(seed):
    rng = np.random.default_rng(seed)
    params = SuffixParams(max_tree_depth=5, max_cached_requests=3, max_spec_factor=2.0, min_token_prob=0.1)
    cache, live = OutputCache(3), []
    for i in range(40):
        doc = rng.integers(0, 5, size=int(rng.integers(2, 25))).tolist()
        cache.add(f"r{i}", doc)
        live = (live + [doc])[-3:]  # the oldest leaves first
        assert len(cache) == len(live)
        corpus = [t for d in live for t in (*d, -1)]
        for _ in range(5):
            pattern = rng.integers(0, 5, size=int(rng.integers(2, 8))).tolist()
            want = naive_draft(corpus, pattern, 4, params, len(corpus), 2)
            got = cache.search(np.array(pattern), params, 4)
            assert got[0] == want[0] and got[1] == pytest.approx(want[1]), (pattern, live)


def test_a_draft_from_the_cache_stops_where_the_cached_outputs_end():
    # Both cached outputs go on alike up to their ends: the draft is that run, never the separator after it.
    params = SuffixParams(max_tree_depth=8, max_cached_requests=8, max_spec_factor=4.0, min_token_prob=0.1)
    proposer = SuffixProposer(6, params)
    proposer.finish("a", [1, 5, 6, 7, 8])
    proposer.finish("b", [2, 5, 6, 7, 8])
    assert proposer.propose([9, 5, 6]) == [7, 8]


def test_a_cache_of_zero_requests_keeps_nothing():
    cache = OutputCache(0)
    cache.add("a", [1, 2, 3])
    assert len(cache) == 0 and cache.search(np.array([1, 2]), PARAMS, 4) == ([], 0.0)


def test_vllms_suffix_keys_parse_and_bad_values_are_refused():
    cfg = parse_speculative_config('{"method": "suffix"}')
    assert cfg is not None and cfg.num_speculative_tokens == 24  # vLLM's default: the tree depth
    assert cfg.suffix == SuffixParams(24, 10000, 1.0, 0.1)
    cfg = parse_speculative_config(
        {
            "method": "suffix",
            "num_speculative_tokens": 8,
            "suffix_decoding_max_tree_depth": 32,
            "suffix_decoding_max_cached_requests": 0,
            "suffix_decoding_max_spec_factor": 2,
            "suffix_decoding_min_token_prob": 0.5,
        }
    )
    assert cfg is not None and (cfg.num_speculative_tokens, cfg.suffix) == (8, SuffixParams(32, 0, 2.0, 0.5))
    for text, message in {
        '{"method": "suffix", "suffix_decoding_min_token_prob": 2}': "min_token_prob must be a number in",
        '{"method": "suffix", "suffix_decoding_max_spec_factor": 0}': "max_spec_factor must be a number > 0",
        '{"method": "suffix", "suffix_decoding_max_cached_requests": -1}': "max_cached_requests must be an integer",
        '{"method": "suffix", "suffix_decoding_max_tree_depth": 0}': "max_tree_depth must be a positive integer",
        '{"method": "suffix", "prompt_lookup_max": 3}': "keys not supported for 'suffix': prompt_lookup_max",
        '{"method": "ngram", "num_speculative_tokens": 2, "suffix_decoding_max_tree_depth": 3}': "keys not supported",
    }.items():
        with pytest.raises(ConfigError, match=message):
            parse_speculative_config(text)
