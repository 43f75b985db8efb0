"""Suffix decoding proposals: the most frequent continuation of the longest matching suffix, found in the
request's own tokens and in the outputs of requests that finished before it.

A suffix tree over a text answers "which tokens followed this pattern, and how often". The same answers come
from the text itself: the occurrences of the request's last L tokens are the positions where its last token
occurs whose L - 1 tokens before also match; the next token proposed is the most frequent one after those
occurrences, the next after that the most frequent among the occurrences that agreed, and so on. Each step
multiplies an estimate of the draft being right so far (the chosen token's share of the occurrences that
reached it); the draft stops when it falls below `min_token_prob`, and is at most `max_spec_factor` × L tokens
long (a longer match is stronger evidence, so it may propose more). Two sources are searched and the draft
with the larger expected number of accepted tokens (the sum of those estimates) is proposed:

- the request's prompt and output so far (every occurrence but the suffix itself), scanned with numpy;
- the outputs of the last `max_cached_requests` finished requests (answers to similar questions repeat each
  other), kept in one append-only token store with an index from each bigram to where it ends, oldest
  evicted first. A match there needs at least two tokens (one token is weak evidence across requests).
  Requests with a `cache_salt` neither read nor add to it: their tenants share nothing, not even timing.

The longest pattern looked for is `max_tree_depth` tokens.
"""

from __future__ import annotations

import bisect
from array import array
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

SEPARATOR = -1  # between two cached outputs in the store: no match or continuation crosses it
MAX_CANDIDATES = 512  # most recent occurrences of a bigram looked at in the cache


@dataclass(frozen=True)
class SuffixParams:
    max_tree_depth: int  # longest pattern matched
    max_cached_requests: int  # finished outputs kept for other requests (0: none)
    max_spec_factor: float  # at most this many proposals per matched token
    min_token_prob: float  # stop the draft when its estimated probability of being right falls below


NARROW_FIRST = 32  # more candidates than this are first filtered one depth at a time, at most NARROW_DEPTHS deep
NARROW_DEPTHS = 2


def longest_match(corpus: np.ndarray, ends: np.ndarray, pattern: np.ndarray, max_len: int) -> tuple[np.ndarray, int]:
    """Of the candidate positions `ends` (where `corpus` holds the pattern's last token), those where the
    longest suffix of `pattern` (at most `max_len` tokens) that any of them matches ends, and its length.

    Many candidates are first narrowed one depth at a time (in text most fail within a token or two); the
    rest are compared at every remaining depth at once ([candidates, depths]), where a repeated span would
    otherwise take one round of numpy calls per matched token."""
    length = 1
    limit = min(max_len, len(pattern))
    while length < min(limit, 1 + NARROW_DEPTHS) and len(ends) > NARROW_FIRST:
        earlier = ends[ends >= length]
        agree = earlier[corpus[earlier - length] == pattern[-1 - length]]
        if not len(agree):
            return ends, length
        ends, length = agree, length + 1
    if length >= limit or not len(ends):
        return ends, length
    depths = np.arange(length, limit)
    back = ends[:, None] - depths  # [m, limit - length]: the positions compared at each depth
    agree = (back >= 0) & (corpus[np.maximum(back, 0)] == pattern[-1 - depths])
    matched = length + np.logical_and.accumulate(agree, axis=1).sum(axis=1)  # each candidate's match length
    best = int(matched.max())
    return ends[matched == best], best


def _until_separator(run: np.ndarray, prob: float) -> tuple[list[int], float]:
    """The tokens of `run` before its first separator, each with the estimate `prob`, and their sum."""
    stop = np.flatnonzero(run == SEPARATOR)
    kept = (run[: stop[0]] if len(stop) else run).tolist()
    return kept, prob * len(kept)


def continuation(
    corpus: np.ndarray, ends: np.ndarray, max_tokens: int, min_token_prob: float
) -> tuple[list[int], float]:
    """The most frequent continuation after the occurrences ending at `ends`, and its expected number of
    accepted tokens (the sum of the running estimates).

    The tokens after every occurrence are read once, as a window [occurrences, max_tokens] (-1 past the corpus
    end, like a separator); then column by column, among the occurrences still agreeing with the draft: where
    they all go on alike the token's share is 1 (the estimate stays), else the most frequent token (ties: the
    smallest id) with its share of the occurrences that reached the column, those that ended there included."""
    if not len(ends) or max_tokens <= 0:
        return [], 0.0
    if len(ends) == 1:
        start = int(ends[0]) + 1
        return _until_separator(corpus[start : start + max_tokens], 1.0)
    prob = 1.0
    n = len(corpus)
    positions = ends[:, None] + np.arange(1, max_tokens + 1)
    window = np.where(positions < n, corpus[np.minimum(positions, n - 1)], SEPARATOR)  # [m, max_tokens]
    first = window[0]
    unanimous = (window == first).all(axis=0) & (first != SEPARATOR)
    run = max_tokens if unanimous.all() else int(unanimous.argmin())  # columns where every occurrence agrees
    draft, score = first[:run].tolist(), float(run)
    alive = window[:, run:]
    for j in range(max_tokens - run):
        col = alive[:, j]
        if len(col) == 1:  # one occurrence left: the rest of its run, every token with the same estimate
            rest, more = _until_separator(alive[0, j:], prob)
            return draft + rest, score + more
        token = int(col[0])
        if token != SEPARATOR and (col == token).all():
            draft.append(token)
            score += prob
            continue
        valid = col[col != SEPARATOR]
        if not len(valid):
            break
        token = int(valid[0])
        if (valid == token).all():  # the ones that go on agree; some ended here
            count = len(valid)
        else:
            values, counts = np.unique(valid, return_counts=True)
            best = int(np.argmax(counts))
            token, count = int(values[best]), int(counts[best])
        prob *= count / len(col)
        if prob < min_token_prob:
            break
        draft.append(token)
        score += prob
        alive = alive[col == token]
    return draft, score


class OutputCache:
    """Outputs of finished requests, oldest evicted first, with a bigram index into one token store."""

    def __init__(self, max_requests: int):
        self.max_requests = max_requests
        self._store = np.full(1024, SEPARATOR, dtype=np.int64)
        self._size = 0  # tokens (and separators) written
        self._live_start = 0  # store offset of the oldest cached output: everything before it is evicted
        self._docs: OrderedDict[str, int] = OrderedDict()  # request id -> its start offset, oldest first
        self._index: dict[int, array] = {}  # bigram key -> store offsets of its second token, ascending

    def __len__(self) -> int:
        return len(self._docs)

    @staticmethod
    def _key(first: int, second: int) -> int:
        return (first << 32) | second

    def add(self, request_id: str, tokens: list[int]) -> None:
        if self.max_requests <= 0 or len(tokens) < 2 or request_id in self._docs:
            return
        while len(self._docs) >= self.max_requests:
            self._docs.popitem(last=False)
            self._live_start = next(iter(self._docs.values()), self._size)
        if self._live_start > self._size - self._live_start:
            self._compact()
        need = self._size + len(tokens) + 1
        if need > len(self._store):
            grown = np.full(max(need, 2 * len(self._store)), SEPARATOR, dtype=np.int64)
            grown[: self._size] = self._store[: self._size]
            self._store = grown
        start = self._size
        self._store[start : start + len(tokens)] = tokens
        self._size = start + len(tokens) + 1  # the separator after it is already in place
        self._docs[request_id] = start
        for offset in range(1, len(tokens)):
            self._index.setdefault(self._key(tokens[offset - 1], tokens[offset]), array("q")).append(start + offset)

    def _compact(self) -> None:
        """Drop the evicted prefix of the store and rebase the index (amortised: at most once per its size)."""
        shift = self._live_start
        live = self._store[shift : self._size].copy()
        self._store[: len(live)] = live
        self._store[len(live) :] = SEPARATOR
        self._size -= shift
        self._live_start = 0
        self._docs = OrderedDict((rid, start - shift) for rid, start in self._docs.items())
        index: dict[int, array] = {}
        for key, offsets in self._index.items():
            kept = offsets[bisect.bisect_left(offsets, shift) :]
            if len(kept):
                index[key] = array("q", (o - shift for o in kept))
        self._index = index

    def search(self, pattern: np.ndarray, params: SuffixParams, max_tokens: int) -> tuple[list[int], float]:
        if len(pattern) < 2 or not self._docs:
            return [], 0.0
        offsets = self._index.get(self._key(int(pattern[-2]), int(pattern[-1])))
        if offsets is None:
            return [], 0.0
        first = max(bisect.bisect_left(offsets, self._live_start + 1), len(offsets) - MAX_CANDIDATES)
        if first >= len(offsets):
            return [], 0.0
        ends = np.frombuffer(offsets, dtype=np.int64)[first:].copy()  # no view: the array grows later
        corpus = self._store[: self._size]
        ends, length = longest_match(corpus, ends, pattern, params.max_tree_depth)
        return continuation(corpus, ends, min(max_tokens, int(params.max_spec_factor * length)), params.min_token_prob)


class SuffixProposer:
    def __init__(self, num_speculative_tokens: int, params: SuffixParams):
        self.k, self.params = num_speculative_tokens, params
        self.cache = OutputCache(params.max_cached_requests)

    def propose(self, tokens: np.ndarray | list[int], k: int | None = None, shared: bool = True) -> list[int]:
        """Up to `k` proposals for the sequence `tokens`; `shared`: also search other requests' outputs."""
        k = self.k if k is None else k
        seq = np.asarray(tokens, dtype=np.int64)
        if k <= 0 or not len(seq):
            return []
        pattern = seq[-self.params.max_tree_depth :]
        # Earlier occurrences of the last token: every position but the last (whose continuation is unknown).
        ends = np.flatnonzero(seq[:-1] == seq[-1])
        own: tuple[list[int], float] = ([], 0.0)
        if len(ends):
            ends, length = longest_match(seq, ends, pattern, self.params.max_tree_depth)
            limit = min(k, int(self.params.max_spec_factor * length))
            own = continuation(seq, ends, limit, self.params.min_token_prob)
        if shared:
            other = self.cache.search(pattern, self.params, k)
            if other[1] > own[1]:
                return other[0]
        return own[0]

    def finish(self, request_id: str, output_token_ids: list[int]) -> None:
        """A request finished: its output joins the cache other requests search."""
        self.cache.add(request_id, output_token_ids)
