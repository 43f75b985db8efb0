"""Tests for pagoda.engine.block_manager.BlockManager.

The property test drives a BlockManager through random admissions, compute steps, growth, finishes,
aborts and preemptions, and checks it against a shadow model kept here:
- a shadow "KV content" per block slot (the whole token prefix that produced it), so a prefix-cache
  hit that hands out a block holding other content, or a write into a block another request
  still reads, is caught;
- block accounting recomputed from the live requests (free count, ref counts, sharing rules);
- the allocation rule: allocate succeeds iff the missing blocks fit in the free pool.
"""

from __future__ import annotations

import itertools

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from pagoda.engine.block_manager import NULL_BLOCK, BlockManager, hash_block
from pagoda.request import Request
from pagoda.sampling_params import SamplingParams

_ids = itertools.count()


def make_request(prompt: list[int], rid: str | None = None) -> Request:
    return Request(rid or f"r{next(_ids)}", list(prompt), SamplingParams(), max_tokens=16)


def tokens_of(r: Request) -> list[int]:
    return r.prompt_token_ids + r.output_token_ids


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def compute_all(bm: BlockManager, r: Request) -> None:
    """Allocate and 'compute' every token of r, then register its full blocks (one step)."""
    n = r.num_tokens - r.num_computed_tokens
    assert bm.allocate(r, n)
    r.num_computed_tokens += n
    bm.cache_full_blocks(r)


# ------------------------------------------------------------------------------------------------
# Property test
# ------------------------------------------------------------------------------------------------


class BlockManagerMachine(RuleBasedStateMachine):
    @initialize(
        num_blocks=st.integers(2, 10) | st.integers(2, 40),  # small pools evict more
        block_size=st.sampled_from([1, 2, 4]) | st.integers(1, 8),
        prefix_caching=st.sampled_from([True, True, True, False]),
        bases=st.lists(st.lists(st.integers(1, 3), min_size=16, max_size=16), min_size=1, max_size=2),
        reuse_first=st.booleans(),
        keep_free=st.integers(0, 6),
        prefer_runs=st.booleans(),
        copy_hits=st.sampled_from([0, 0, 1, 3, 16]),
        copy_below=st.sampled_from([1, 3, 100]),
    )
    def setup(
        self, num_blocks, block_size, prefix_caching, bases, reuse_first, keep_free, prefer_runs, copy_hits, copy_below
    ):
        keep_free_tokens = keep_free * block_size if reuse_first else None
        self.bm = BlockManager(
            num_blocks,
            block_size,
            prefix_caching,
            keep_free_tokens=keep_free_tokens,
            prefer_runs=prefer_runs,
            copy_hits_max_tokens=copy_hits * block_size,
            copy_hits_below=copy_below,
        )
        self.bs = block_size
        self.bases = bases
        self.live: list[Request] = []  # hold blocks
        self.waiting: list[Request] = []  # hold no blocks (never admitted, failed admission, preempted)
        # Shadow KV: (block, offset) -> the token prefix whose last token's K/V is stored there.
        self.content: dict[tuple[int, int], tuple[int, ...]] = {}
        self.seen: list[list[int]] = []  # token sequences computed so far (to ask for them again)

    # ---- helpers ----------------------------------------------------------------------------
    def _holders(self, block: int, exclude: Request | None = None) -> list[Request]:
        return [r for r in self.live if r is not exclude and block in r.block_ids]

    def _check_reads(self, r: Request) -> None:
        toks = tokens_of(r)
        for p in range(r.num_computed_tokens):
            slot = (r.block_ids[p // self.bs], p % self.bs)
            assert self.content.get(slot) == tuple(toks[: p + 1]), (
                f"{r.request_id}: position {p} in block {slot[0]} holds other content"
            )

    def _admit(self, r: Request, data) -> None:
        assert not r.block_ids and r.num_computed_tokens == 0
        hits = self.bm.match_prefix(r, running=len(self.live))
        # Copied hits: the worker copies each source block into the request's own before the step writes anything
        # (here: before any later rule runs). A copy is never shared, and its source stays in the cache.
        if r.block_copies:
            assert [d for _, d in r.block_copies] == r.block_ids and len(self.live) < self.bm.copy_hits_below
            for src, dst in r.block_copies:
                assert self.bm.hash_of[dst] is None and not self._holders(dst, exclude=r)
                for offset in range(self.bs):
                    if (src, offset) in self.content:
                        self.content[(dst, offset)] = self.content[(src, offset)]
            r.block_copies = []
        assert hits % self.bs == 0
        assert 0 <= hits <= r.num_tokens - 1, "at least one token must be left to compute"
        if not self.bm.enable_prefix_caching:
            assert hits == 0
        assert len(r.block_ids) == hits // self.bs
        r.num_computed_tokens = hits
        if r.num_cached_tokens < 0:
            r.num_cached_tokens = hits
        self._check_reads(r)  # every hit block holds exactly this prefix
        free_before = self.bm.num_free_blocks
        chunk = r.num_tokens - hits
        if data.draw(st.booleans(), label="partial"):
            chunk = data.draw(st.integers(1, chunk), label="chunk")
        need = cdiv(hits + chunk, self.bs) - len(r.block_ids)
        assert self.bm.can_allocate(r, chunk) == (need <= free_before)
        ok = self.bm.allocate(r, chunk)
        assert ok == (need <= free_before)
        if ok:
            assert len(r.block_ids) == cdiv(hits + chunk, self.bs)
            assert self.bm.num_free_blocks == free_before - need
            self.live.append(r)
        else:
            assert len(r.block_ids) == hits // self.bs
            self.bm.free(r)
            r.num_computed_tokens = 0
            self.waiting.append(r)

    # ---- rules ------------------------------------------------------------------------------
    @rule(data=st.data())
    def add_new(self, data):
        base = data.draw(st.sampled_from(self.bases), label="base")
        k = data.draw(
            st.sampled_from([len(base), len(base) // 2, len(base) // 4]) | st.integers(0, len(base)), label="prefix"
        )
        tail = data.draw(st.lists(st.integers(1, 3), max_size=2), label="tail")
        prompt = base[:k] + tail or [1]
        self._admit(make_request(prompt), data)

    @precondition(lambda self: self.seen)
    @rule(data=st.data())
    def add_seen(self, data):
        seen = data.draw(st.sampled_from(self.seen), label="seen")
        k = data.draw(st.sampled_from([len(seen)]) | st.integers(1, len(seen)), label="prefix")
        tail = data.draw(st.lists(st.integers(1, 3), max_size=2), label="tail")
        self._admit(make_request(seen[:k] + tail), data)

    @precondition(lambda self: self.waiting)
    @rule(data=st.data())
    def readmit(self, data):
        r = data.draw(st.sampled_from(self.waiting), label="readmit")
        self.waiting.remove(r)
        self._admit(r, data)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def compute(self, data):
        r = data.draw(st.sampled_from(self.live), label="compute")
        cap = min(len(r.block_ids) * self.bs, r.num_tokens)
        if cap > r.num_computed_tokens:
            self._check_reads(r)
            n = cap - r.num_computed_tokens  # usually everything allocated, like a real step
            if data.draw(st.booleans(), label="partial"):
                n = data.draw(st.integers(1, n), label="n")
            toks = tokens_of(r)
            for p in range(r.num_computed_tokens, r.num_computed_tokens + n):
                block = r.block_ids[p // self.bs]
                others = self._holders(block, exclude=r)
                assert not others, f"writing block {block} shared with {[o.request_id for o in others]}"
                self.content[(block, p % self.bs)] = tuple(toks[: p + 1])
            r.num_computed_tokens += n
            self.bm.cache_full_blocks(r)
            if r.num_computed_tokens >= self.bs:
                self.seen.append(toks[: r.num_computed_tokens])
        if r.num_computed_tokens == r.num_tokens and data.draw(st.booleans(), label="sample"):
            r.output_token_ids.append(data.draw(st.integers(1, 3), label="token"))

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def grow(self, data):
        r = data.draw(st.sampled_from(self.live), label="grow")
        remaining = r.num_tokens - r.num_computed_tokens
        if remaining == 0:
            return
        n = data.draw(st.integers(1, remaining), label="n")
        need = max(cdiv(r.num_computed_tokens + n, self.bs) - len(r.block_ids), 0)
        before, free_before = list(r.block_ids), self.bm.num_free_blocks
        assert self.bm.can_allocate(r, n) == (need <= free_before)
        ok = self.bm.allocate(r, n)
        assert ok == (need <= free_before)
        if ok:
            assert r.block_ids[: len(before)] == before and len(r.block_ids) == len(before) + need
        else:
            assert r.block_ids == before and self.bm.num_free_blocks == free_before

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def finish(self, data):
        r = data.draw(st.sampled_from(self.live), label="finish")
        self.live.remove(r)
        self.bm.free(r)
        assert r.block_ids == []

    @precondition(lambda self: self.live or self.waiting)
    @rule(data=st.data())
    def abort(self, data):
        r = data.draw(st.sampled_from(self.live + self.waiting), label="abort")
        if r in self.live:
            self.live.remove(r)
            self.bm.free(r)
        else:
            self.waiting.remove(r)
        assert r.block_ids == []

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def preempt(self, data):
        r = data.draw(st.sampled_from(self.live), label="preempt")
        self.live.remove(r)
        self.bm.free(r)
        r.num_computed_tokens = 0
        self.waiting.append(r)

    @rule()
    def reset_prefix_cache(self):
        self.bm.reset_prefix_cache()

    # ---- invariants -------------------------------------------------------------------------
    @invariant()
    def integrity(self):
        if not hasattr(self, "bm"):
            return
        bm = self.bm
        bm.check_integrity(self.live)
        for r in self.waiting:
            assert r.block_ids == [] and r.num_computed_tokens == 0
        holders: dict[int, list[tuple[Request, int]]] = {}
        for r in self.live:
            assert len(set(r.block_ids)) == len(r.block_ids), "a block listed twice in one request"
            assert NULL_BLOCK not in r.block_ids
            assert all(1 <= b < bm.num_blocks for b in r.block_ids)
            assert len(r.block_ids) * self.bs >= r.num_computed_tokens
            for i, b in enumerate(r.block_ids):
                holders.setdefault(b, []).append((r, i))
        assert bm.num_free_blocks == bm.num_usable_blocks - len(holders)
        for b in range(bm.num_blocks):
            assert bm.ref_count[b] == len(holders.get(b, []))
        for b, hs in holders.items():
            if len(hs) > 1:
                # Only full, computed prefix blocks with identical whole prefixes may be shared.
                (r0, i0) = hs[0]
                prefix = tokens_of(r0)[: (i0 + 1) * self.bs]
                for r, i in hs:
                    assert i == i0, f"block {b} shared at different positions"
                    assert (i + 1) * self.bs <= r.num_computed_tokens, f"block {b} shared while not full+computed"
                    assert tokens_of(r)[: (i + 1) * self.bs] == prefix, f"block {b} shared across different prefixes"

    def teardown(self):
        if not hasattr(self, "bm"):
            return
        for r in self.live:
            self.bm.free(r)
        self.live = []
        self.bm.check_integrity([])
        assert self.bm.num_free_blocks == self.bm.num_blocks - 1
        assert all(c == 0 for c in self.bm.ref_count)


BlockManagerMachine.TestCase.settings = settings(
    max_examples=200,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
test_block_manager_state_machine = BlockManagerMachine.TestCase


# ------------------------------------------------------------------------------------------------
# Deterministic tests
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bs", [1, 4, 8])
def test_prefix_reuse_after_finish(bs):
    bm = BlockManager(32, bs)
    prefix = [(i % 5) + 1 for i in range(3 * bs)]
    a = make_request(prefix + [9] * (bs // 2 + 1))
    assert bm.match_prefix(a) == 0
    compute_all(bm, a)
    a_blocks = list(a.block_ids)
    bm.free(a)
    b = make_request(prefix + [8, 8])  # diverges right after the 3 full blocks
    assert bm.match_prefix(b) == 3 * bs
    assert bm.prefix_queries == a.num_tokens + b.num_tokens and bm.prefix_hits == 3 * bs
    assert b.block_ids == a_blocks[:3]
    assert all(bm.ref_count[x] == 1 for x in b.block_ids)
    b.num_computed_tokens = 3 * bs
    bm.check_integrity([b])


def test_prefix_shared_with_live_request():
    bs = 4
    bm = BlockManager(32, bs)
    a = make_request(list(range(1, 13)) + [50])  # 3 full blocks + 1 token
    compute_all(bm, a)
    b = make_request(list(range(1, 13)) + [60, 61])
    assert bm.match_prefix(b) == 12
    assert b.block_ids == a.block_ids[:3]
    assert [bm.ref_count[x] for x in a.block_ids] == [2, 2, 2, 1]
    b.num_computed_tokens = 12
    assert bm.allocate(b, 2)
    assert b.block_ids[3] != a.block_ids[3]
    bm.check_integrity([a, b])
    bm.free(a)
    bm.free(b)
    assert bm.num_free_blocks == 31 and not any(bm.ref_count)


@pytest.mark.parametrize("bs", [1, 2, 4])
def test_fully_cached_prompt_leaves_one_token(bs):
    bm = BlockManager(32, bs)
    prompt = [(i % 3) + 1 for i in range(3 * bs)]
    a = make_request(prompt)
    compute_all(bm, a)
    bm.free(a)
    b = make_request(prompt)
    hits = bm.match_prefix(b)
    assert hits == 2 * bs  # the third block holds the last token, which must run
    assert b.num_tokens - hits >= 1
    # Same for the request that computed it, whose block hashes already cover the whole prompt.
    a.num_computed_tokens = 0
    assert len(a.block_hashes) == 3
    assert bm.match_prefix(a) == 2 * bs
    # A single-token prompt can never hit anything.
    bm2 = BlockManager(8, 1)
    c = make_request([5])
    compute_all(bm2, c)
    bm2.free(c)
    assert bm2.match_prefix(make_request([5])) == 0


def test_no_hit_after_a_gap():
    # A later block of a prefix can stay cached after an earlier one was evicted (here the later
    # one was computed by another request); a hit needs every block before it to hit as well.
    bm = BlockManager(8, 2)  # 7 usable blocks
    a = make_request([1, 1, 5])
    b = make_request([1, 1, 2, 2, 5])
    assert bm.allocate(a, 3) and bm.allocate(b, 5)
    a.num_computed_tokens, b.num_computed_tokens = 3, 5
    bm.cache_full_blocks(a)  # [1, 1] is cached in a's block
    bm.cache_full_blocks(b)  # [1, 1] | [2, 2] is cached in b's second block
    bm.free(a)
    filler = make_request([9] * 8)
    assert bm.allocate(filler, 8)  # takes every free block, evicting a's [1, 1]
    assert a.block_ids == [] and bm.num_free_blocks == 0
    bm.free(filler)
    f = make_request([1, 1, 2, 2, 9])
    assert bm.match_prefix(f) == 0 and f.block_ids == []
    bm.check_integrity([b])


def test_prefix_caching_disabled_never_hits():
    bm = BlockManager(16, 2, enable_prefix_caching=False)
    a = make_request([1, 2, 3, 4, 5])
    compute_all(bm, a)
    bm.free(a)
    b = make_request([1, 2, 3, 4, 5])
    assert bm.match_prefix(b) == 0 and b.block_ids == []


def test_lru_eviction_order_and_revival():
    bs = 2
    bm = BlockManager(5, bs)  # 4 usable blocks
    a = make_request([1, 1, 2, 2])  # 2 full blocks
    b = make_request([3, 3, 4, 4])
    compute_all(bm, a)
    compute_all(bm, b)
    a0, a1 = a.block_ids
    b0, b1 = b.block_ids
    assert bm.num_free_blocks == 0
    bm.free(a)  # freed first: oldest; tail block before head block
    bm.free(b)
    assert bm.num_free_blocks == 4
    assert list(bm._free) == [a1, a0, b1, b0]

    # Revive b's first block: it leaves the free list and is never handed out while held.
    d = make_request([3, 3, 4, 4, 9])
    assert bm.match_prefix(d) == 4  # both of b's blocks are still cached
    assert d.block_ids == [b0, b1]
    assert bm.num_free_blocks == 2 and b0 not in bm._free and b1 not in bm._free
    bm.free(d)  # back at the young end, tail first
    assert list(bm._free) == [a1, a0, b1, b0]

    e = make_request([3, 3, 7])
    assert bm.match_prefix(e) == 2 and e.block_ids == [b0]
    assert b0 not in bm._free
    e.num_computed_tokens = 2
    # e needs 1 more block: the oldest free one is a's tail block, which loses its cached content.
    assert bm.allocate(e, 1)
    assert e.block_ids == [b0, a1]
    assert list(bm._free) == [a0, b1]

    # a's prefix now only hits its first block: the chain broke at the evicted second block.
    f = make_request([1, 1, 2, 2, 5])
    assert bm.match_prefix(f) == 2 and f.block_ids == [a0]
    bm.check_integrity([e, f])
    # Allocating the rest never hands out a block that is held.
    f.num_computed_tokens = 2
    assert not bm.allocate(f, 3)  # needs 2 more blocks, only 1 free
    assert f.block_ids == [a0]
    assert bm.allocate(f, 2)
    assert f.block_ids == [a0, b1]
    assert not bm.allocate(make_request([1]), 1)
    bm.check_integrity([e, f])


def test_evicted_content_is_not_hit():
    bm = BlockManager(3, 2)  # 2 usable blocks
    a = make_request([1, 2, 3, 4])
    compute_all(bm, a)
    bm.free(a)
    b = make_request([5, 6, 7, 8])  # reuses both blocks for new content
    assert bm.match_prefix(b) == 0
    compute_all(bm, b)
    bm.free(b)
    assert bm.match_prefix(make_request([1, 2, 3, 4, 5])) == 0
    c = make_request([5, 6, 7, 8, 1])
    assert bm.match_prefix(c) == 4


def test_reset_prefix_cache_forgets_only_free_blocks():
    bm = BlockManager(16, 2)
    a = make_request([1, 2, 3, 4, 5])
    b = make_request([6, 7, 8, 9, 5])
    compute_all(bm, a)
    compute_all(bm, b)
    bm.free(a)  # a's blocks are free but cached; b's are held
    bm.reset_prefix_cache()
    assert bm.match_prefix(make_request([1, 2, 3, 4, 5])) == 0
    c = make_request([6, 7, 8, 9, 5])
    assert bm.match_prefix(c) == 4 and c.block_ids == b.block_ids[:2]
    c.num_computed_tokens = 4
    bm.check_integrity([b, c])


def test_hash_chain():
    toks = [1, 2, 3, 4]
    p1 = hash_block(None, [9, 9, 9, 9])
    p2 = hash_block(None, [8, 8, 8, 8])
    assert hash_block(p1, toks) == hash_block(p1, list(toks))
    assert hash_block(p1, toks) != hash_block(p2, toks)
    assert hash_block(None, toks) != hash_block(p1, toks)
    assert hash_block(None, [1, 2]) != hash_block(None, [2, 1])
    # Through the manager: the same second block after a different first block is no hit.
    bm = BlockManager(16, 4)
    a = make_request([9, 9, 9, 9] + toks + [5])
    compute_all(bm, a)
    bm.free(a)
    b = make_request([8, 8, 8, 8] + toks + [5])
    assert bm.match_prefix(b) == 0
    assert b.block_hashes[1] != a.block_hashes[1]
    assert b.block_hashes[1] == hash_block(b.block_hashes[0], toks)


def test_null_block_never_handed_out():
    for bs in (1, 3):
        bm = BlockManager(9, bs)
        reqs = []
        for _ in range(8):
            r = make_request([1] * bs)
            assert bm.allocate(r, bs)
            reqs.append(r)
        ids = sorted(b for r in reqs for b in r.block_ids)
        assert ids == list(range(1, 9))
        assert bm.num_free_blocks == 0
        extra = make_request([2])
        assert not bm.allocate(extra, 1) and extra.block_ids == []
        bm.check_integrity(reqs)
        for r in reqs:
            bm.free(r)
        assert bm.num_free_blocks == 8


def test_check_integrity_detects_corruption():
    bm = BlockManager(8, 2)
    a = make_request([1, 2, 3])
    compute_all(bm, a)
    bm.check_integrity([a])
    held = a.block_ids[0]
    bm.ref_count[held] += 1
    with pytest.raises(RuntimeError):
        bm.check_integrity([a])
    bm.ref_count[held] -= 1
    bm.check_integrity([a])
    free_block = next(iter(bm._fresh))  # a never-used free block
    bm.ref_count[free_block] = 1
    with pytest.raises(RuntimeError):
        bm.check_integrity([a])
    bm.ref_count[free_block] = 0
    # A request listing a block twice, or the null block, is caught too.
    a.block_ids.append(a.block_ids[0])
    with pytest.raises(RuntimeError):
        bm.check_integrity([a])
    a.block_ids.pop()
    a.block_ids.append(NULL_BLOCK)
    with pytest.raises(RuntimeError):
        bm.check_integrity([a])
    a.block_ids.pop()
    bm.check_integrity([a])
    # Forgetting a holder is caught.
    with pytest.raises(RuntimeError):
        bm.check_integrity([])


def test_cache_salt_separates_prefix_caches() -> None:
    # Same tokens: a hit only for the same salt (or no salt on both), and the salt changes every block's hash.
    bm = BlockManager(num_blocks=32, block_size=4)

    def admit(rid: str, salt: str | None) -> int:
        r = Request(rid, list(range(1, 14)), SamplingParams(), 4, cache_salt=salt)
        hits = bm.match_prefix(r)
        assert bm.allocate(r, r.num_tokens - hits)
        r.num_computed_tokens = r.num_tokens
        bm.cache_full_blocks(r)
        return hits

    assert admit("a1", "tenant-a") == 0
    assert admit("a2", "tenant-a") == 12
    assert admit("b1", "tenant-b") == 0
    assert admit("n1", None) == 0
    assert admit("n2", None) == 12
    assert admit("b2", "tenant-b") == 12


# ------------------------------------------------------------------------------------------------
# The pool's memory policy: fresh blocks first (GPU) or freed blocks first (CPU)
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("prefer_runs", [False, True])
@pytest.mark.parametrize(("reuse_first", "keep_free"), [(False, 0), (True, 0), (True, 10)])
def test_blocks_ever_handed_out_follow_the_policy(reuse_first, keep_free, prefer_runs):
    """Two requests at a time, 40 in all, 3 blocks each: reusing freed blocks first keeps the blocks ever
    handed out (the CPU pool's resident part) at the peak in use plus the `keep_free` cached blocks;
    fresh-first walks the whole pool. Preferring runs changes neither."""
    bm = BlockManager(201, 2, keep_free_tokens=2 * keep_free if reuse_first else None, prefer_runs=prefer_runs)
    handed_out: set[int] = set()
    live: list[Request] = []
    for i in range(40):
        r = make_request([i % 7 + 1, i, i + 1, i + 2, i + 3, i + 4])  # distinct content: no prefix hits
        compute_all(bm, r)
        handed_out.update(r.block_ids)
        live.append(r)
        if len(live) == 2:
            bm.free(live.pop(0))
        bm.check_integrity(live)
    assert bm.num_touched_blocks == len(handed_out)
    if reuse_first:
        assert 6 + keep_free <= len(handed_out) <= 6 + keep_free + 3
    else:
        assert len(handed_out) == 120


def test_kept_free_blocks_outlive_a_request_between_two_with_one_prefix():
    """A request of other content between two that share a prefix: with a context's worth of freed blocks kept,
    the prefix is still cached for the second (with none kept, the middle request took its blocks)."""
    shared = [5, 6, 7, 8, 9, 10, 11, 12]
    for keep_free, expected in ((4, 8), (0, 0)):
        bm = BlockManager(32, 2, keep_free_tokens=2 * keep_free)
        a = make_request([*shared, 1])
        compute_all(bm, a)
        bm.free(a)
        b = make_request([20, 21, 22, 23, 24, 25, 26, 27, 28])
        compute_all(bm, b)
        bm.free(b)
        c = make_request([*shared, 2])
        assert bm.match_prefix(c) == expected, keep_free
        bm.check_integrity([c])


def test_reusing_freed_blocks_first_evicts_the_oldest_cached_prefix_first():
    bm = BlockManager(32, 2, keep_free_tokens=0)
    shared = [5, 6, 7, 8, 9, 10, 11, 12]
    a = make_request(shared)
    compute_all(bm, a)
    bm.free(a)  # its 4 blocks are free and cached; the tail ones freed first
    b = make_request([1, 2, 3, 4])
    compute_all(bm, b)  # takes two of a's freed blocks, not fresh ones
    assert set(b.block_ids) <= {*a.block_ids, *range(1, 5)} and bm.num_touched_blocks == 4
    c = make_request([*shared[:4], 99, 98, 97])
    assert bm.match_prefix(c) == 4  # the prefix's head blocks were the last to go: still cached
    bm.check_integrity([b, c])


def test_the_cpu_engine_config_reuses_freed_blocks_past_its_reserve(monkeypatch):
    from pagoda.config import EngineArgs, EngineConfig

    def reserve(**kw):
        return EngineConfig.create(EngineArgs(device="cpu", **kw)).cache.freed_block_reserve_tokens

    assert reserve() == 2048  # the default model's context is longer
    assert reserve(max_model_len=512) == 512  # never more than one context
    monkeypatch.setenv("PAGODA_CPU_KV_RESERVE_TOKENS", "100")
    assert reserve() == 100
    monkeypatch.setenv("PAGODA_CPU_KV_RESERVE_TOKENS", "-3")
    assert reserve() == 0
    monkeypatch.setenv("PAGODA_CPU_KV_REUSE_FIRST", "0")
    assert reserve() is None  # never-used blocks first, as on a GPU


# ------------------------------------------------------------------------------------------------
# Runs of blocks (CPU: one ascending run is attended in place)
# ------------------------------------------------------------------------------------------------


def _one_run(blocks: list[int]) -> bool:
    return all(b == a + 1 for a, b in zip(blocks, blocks[1:]))


@pytest.mark.parametrize("keep_free", [None, 1000])
def test_a_next_turn_continues_the_run_its_prefix_hit_ends(keep_free):
    """Turn 2 of a chat repeats turn 1 and adds to it: its prefix hit ends just before turn 1's partial last block,
    which caches nothing, so that block and the ones after it continue the run (without `prefer_runs` the
    partial block is skipped and the run breaks)."""
    for prefer_runs in (True, False):
        bm = BlockManager(64, 4, keep_free_tokens=keep_free, prefer_runs=prefer_runs)
        other = make_request(list(range(100, 110)))  # blocks handed out before the chat's
        compute_all(bm, other)
        turn1 = make_request(list(range(1, 15)))  # 3 full blocks + 2 tokens
        compute_all(bm, turn1)
        bm.free(other)
        bm.free(turn1)
        turn2 = make_request(list(range(1, 15)) + list(range(50, 60)))
        assert bm.match_prefix(turn2) == 12
        turn2.num_computed_tokens = 12
        assert bm.allocate(turn2, turn2.num_tokens - 12)
        assert _one_run(turn2.block_ids) == prefer_runs, (prefer_runs, turn2.block_ids)
        bm.check_integrity([turn2])


def test_reused_freed_blocks_come_out_as_runs():
    """Past the kept reserve the CPU policy reuses freed blocks, oldest first; a finished request's tail is freed
    first, so popped alone they come out descending. With `prefer_runs` requests of one at a time (a prompt's
    blocks, then one block per 4 decoded tokens) are one ascending run but where a run meets the top of the pool's
    resident part (never-used blocks are not taken ahead of freed ones), and that resident part stays the
    policy's."""
    for prefer_runs in (True, False):
        bm = BlockManager(129, 4, keep_free_tokens=4 * 8, prefer_runs=prefer_runs)
        runs = 0
        for i in range(30):
            r = make_request([i + 1000] + [(7 * i + j) % 500 + 1 for j in range(7)])  # a 2-block prompt
            compute_all(bm, r)
            for _ in range(3):  # decode grows it a block at a time
                r.output_token_ids.extend([1, 2, 3, 4])
                compute_all(bm, r)
            runs += _one_run(r.block_ids)
            bm.free(r)
        assert bm.num_touched_blocks <= 5 + 8 + 5
        assert runs >= 24 if prefer_runs else runs <= 6, (prefer_runs, runs)


def test_a_cached_block_after_the_run_is_not_evicted_while_fresh_blocks_remain():
    bm = BlockManager(32, 2, prefer_runs=True)  # fresh first (the GPU's policy shape)
    a = make_request([1, 2, 3, 4])
    compute_all(bm, a)  # blocks 1, 2, both cached
    bm.free(a)
    c = make_request([1, 2, 7, 7])
    assert bm.match_prefix(c) == 2 and c.block_ids == [1]
    c.num_computed_tokens = 2
    assert bm.allocate(c, 2)  # block 2 would continue the run, but it caches [3, 4]: a fresh block instead
    assert c.block_ids == [1, 3] and bm.hash_of[2] is not None
    bm.check_integrity([c])


def _chat_after_another(bm: BlockManager) -> tuple[Request, list[int]]:
    """A first chat (system prompt + question) computed and finished, then a second chat with the same system
    prompt: its hit blocks are followed in the pool by the first chat's question, which stays cached."""
    system = list(range(1, 9))  # two full blocks of 4
    first = make_request(system + [50, 51, 52, 53, 54, 55])
    compute_all(bm, first)
    sources = first.block_ids[:2]
    bm.free(first)
    return make_request(system + [60, 61, 62, 63, 64]), sources


def test_a_hit_that_cannot_continue_a_run_is_copied_into_one():
    bm = BlockManager(64, 4, keep_free_tokens=1000, prefer_runs=True, copy_hits_max_tokens=8, copy_hits_below=3)
    second, sources = _chat_after_another(bm)
    assert bm.match_prefix(second, running=0) == 8
    assert [s for s, _ in second.block_copies] == sources
    assert [d for _, d in second.block_copies] == second.block_ids
    assert not set(second.block_ids) & set(sources)
    second.num_computed_tokens = 8
    assert bm.allocate(second, second.num_tokens - 8)
    assert _one_run(second.block_ids), second.block_ids
    assert all(bm.hash_of[s] is not None and bm.ref_count[s] == 0 for s in sources)  # still cached, unheld
    assert all(bm.hash_of[d] is None for _, d in second.block_copies)  # copies stay private
    bm.cache_full_blocks(second)
    assert all(bm.hash_of[d] is None for _, d in second.block_copies)
    bm.check_integrity([second])
    third = make_request(list(range(1, 9)) + [70, 71])
    assert bm.match_prefix(third, running=3) == 8 and third.block_ids == sources  # the cache still holds them


@pytest.mark.parametrize(
    "manager, running",
    [
        (dict(copy_hits_max_tokens=8, copy_hits_below=3), 3),  # enough rows run that decode gathers anyway
        (dict(copy_hits_max_tokens=4, copy_hits_below=3), 0),  # the hit is longer than copies may be
        (dict(copy_hits_max_tokens=0, copy_hits_below=3), 0),  # copies off
    ],
)
def test_a_hit_is_shared_where_copying_buys_nothing_or_costs_too_much(manager, running):
    bm = BlockManager(64, 4, keep_free_tokens=1000, prefer_runs=True, **manager)
    second, sources = _chat_after_another(bm)
    assert bm.match_prefix(second, running=running) == 8
    assert second.block_ids == sources and second.block_copies == []


def test_a_hit_is_shared_when_the_pool_cannot_hold_its_copy():
    bm = BlockManager(6, 4, prefer_runs=True, copy_hits_max_tokens=8, copy_hits_below=3)
    first = make_request(list(range(1, 9)) + [50, 51, 52, 53, 54, 55])
    compute_all(bm, first)  # 4 blocks of the 5 usable
    hog = make_request([90, 91, 92, 93])
    bm.free(first)
    compute_all(bm, hog)  # takes the one never-used block
    bm.free(hog)
    filler = make_request([80, 81, 82, 83, 84])  # 2 blocks: only the 2 cached system blocks stay free
    compute_all(bm, filler)
    second = make_request(list(range(1, 9)) + [60])
    assert bm.match_prefix(second) == 8
    assert second.block_copies == [] and len(second.block_ids) == 2
    bm.check_integrity([filler, second])


def test_a_next_turn_whose_hit_continues_a_run_is_not_copied():
    bm = BlockManager(64, 4, keep_free_tokens=1000, prefer_runs=True, copy_hits_max_tokens=64, copy_hits_below=3)
    turn1 = make_request(list(range(1, 15)))  # 3 full blocks + 2 tokens: the partial block caches nothing
    compute_all(bm, turn1)
    blocks = list(turn1.block_ids)
    bm.free(turn1)
    turn2 = make_request(list(range(1, 15)) + list(range(50, 60)))
    assert bm.match_prefix(turn2) == 12
    assert turn2.block_ids == blocks[:3] and turn2.block_copies == []


def test_a_failed_admission_drops_its_copies():
    bm = BlockManager(64, 4, keep_free_tokens=1000, prefer_runs=True, copy_hits_max_tokens=8, copy_hits_below=3)
    second, sources = _chat_after_another(bm)
    free_before = bm.num_free_blocks
    assert bm.match_prefix(second) == 8 and second.block_copies
    bm.free(second)
    assert second.block_copies == [] and second.block_ids == [] and bm.num_free_blocks == free_before
    assert all(bm.hash_of[s] is not None for s in sources)
    bm.check_integrity([])
