"""Paged-KV bookkeeping: which fixed-size blocks each request owns, and the prefix cache.

Pure Python, no tensors: the worker owns the K/V memory, this class only hands out block ids.

- Block 0 is the null block (pads block tables); ids 1..num_blocks-1 are usable.
- A block is *in use* while ref_count > 0 (several requests can share a cached prefix block).
- Blocks never handed out wait in `_fresh` (in id order); freed blocks wait in `_free` in LRU order
  (oldest first). A free block may still carry the hash of the full block it last held, so a later
  request with the same prefix revives it; it is evicted (hash forgotten) only when handed out for
  new content.
- Which comes first is the pool's memory policy. `keep_free_tokens=None` (GPU: the pool's memory is
  committed at start): fresh blocks first, so cached prefixes live until the whole pool has cycled.
  A number (CPU: a page of the pool becomes resident memory when first written): once more freed blocks
  wait than hold that many tokens, the oldest of them is handed out (its cached prefix evicted) before
  a fresh one, so the resident pool follows the peak number of blocks in use plus that reserve of
  cached prefixes, rather than every block ever handed out.
- `prefer_runs` (CPU, whose attention reads a request's blocks in place when they are one ascending run,
  `layers/torch_attention.py`): a request's next block is the one after its last where that block is free
  and taking it costs the policy nothing: a never-used block the policy would hand out now anyway, a freed
  block that caches nothing (the partial last block of a finished turn, which the next turn's prefix hit
  stops just before), or any freed block when the policy is reusing freed ones (it evicts one either way).
  Freed blocks popped in LRU order alone come out descending (a request frees its tail first).
- `copy_hits_max_tokens` (CPU, same reason): a prefix hit whose blocks do not continue into a run (a chat's
  shared system prompt, followed in the pool by another conversation's blocks) is copied into fresh blocks
  that start the request's own run, instead of being shared, while fewer than `copy_hits_below` requests run
  (more rows are attended as one gathered batch anyway) and the hit holds at most that many tokens. The
  (source, destination) pairs go out with the step (`SchedulerOutput.block_copies`); the worker copies them
  before the step's forward pass writes anything, so a source handed out again in the same step is still
  intact. The copies are private: the cache keeps pointing at the sources.
- A full block's hash chains its parent's: H(parent_hash, token ids), so equal hashes mean equal
  whole prefixes. A request's cache_salt enters its first block's hash, so only requests with the same
  salt (or none) share blocks. Only full blocks are hashed; the last, partial block of a request never is.
Invariant (check_integrity): every usable block is either free (ref 0, in `_free`) or used
(ref = number of requests listing it), and `_cached[h] = b` implies `hash_of[b] == h`.
"""

from __future__ import annotations

import collections
import hashlib
from array import array
from collections import OrderedDict

from pagoda.request import Request

NULL_BLOCK = 0


def hash_block(parent: bytes | None, token_ids: list[int], extra: bytes = b"", salt: str | None = None) -> bytes:
    """Collision-resistant chained hash of one full block (blake2b, 16 bytes). `extra` identifies
    content that the token ids do not (the images behind a block's placeholder tokens); `salt` (a
    request's cache_salt, given for its first block) separates the prefix caches of its holders."""
    h = hashlib.blake2b(parent or b"", digest_size=16)
    h.update(array("q", token_ids).tobytes())
    if extra:
        h.update(b"|mm|" + extra)
    if salt is not None:
        h.update(b"|salt|" + salt.encode("utf-8", "surrogatepass"))
    return h.digest()


class BlockManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        keep_free_tokens: int | None = None,
        prefer_runs: bool = False,
        copy_hits_max_tokens: int = 0,
        copy_hits_below: int = 0,
    ):
        assert num_blocks >= 2, "need the null block plus at least one usable block"
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        # Freed blocks (cached prefixes) kept before the oldest is reused ahead of a fresh one; None: fresh first.
        self.keep_free = None if keep_free_tokens is None else self.blocks_needed(keep_free_tokens)
        self.prefer_runs = prefer_runs  # CPU: a request's blocks as one ascending run are attended in place
        self.copy_hits_max_blocks = copy_hits_max_tokens // block_size  # 0: prefix hits are always shared
        self.copy_hits_below = copy_hits_below
        self.ref_count = [0] * num_blocks
        self.hash_of: list[bytes | None] = [None] * num_blocks
        self._fresh: collections.deque[int] = collections.deque(range(1, num_blocks))
        self._free: OrderedDict[int, None] = OrderedDict()
        self._cached: dict[bytes, int] = {}
        # Prefix-cache statistics, in tokens (for metrics and tests).
        self.prefix_queries = 0
        self.prefix_hits = 0

    # ---- capacity -----------------------------------------------------------------------------
    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        return len(self._free) + len(self._fresh)

    @property
    def num_touched_blocks(self) -> int:
        """Blocks handed out at least once (on the CPU: the part of the pool that is resident memory)."""
        return self.num_usable_blocks - len(self._fresh)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_usable_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---- prefix cache -------------------------------------------------------------------------
    def match_prefix(self, request: Request, running: int = 0) -> int:
        """Attach cached blocks for the longest cached prefix of a request that holds no blocks (or copies of
        them, see `copy_hits_max_tokens`; `running`: how many requests run beside it).

        Returns the number of tokens found. At least one token is always left to compute, since the
        step that computes it produces the logits to sample from.
        """
        assert not request.block_ids and request.num_computed_tokens == 0
        if not self.enable_prefix_caching:
            return 0
        num_tokens = request.num_tokens
        max_blocks = (num_tokens - 1) // self.block_size
        self._extend_hashes(request, max_blocks * self.block_size)
        hits: list[int] = []
        for h in request.block_hashes[:max_blocks]:
            block = self._cached.get(h)
            if block is None:
                break
            hits.append(block)
        for block in hits:
            self._take(block)
        if hits and running < self.copy_hits_below and self._worth_copying(hits):
            copies: list[int] = []
            for _ in hits:  # a run where the policy allows it, as `allocate` continues it
                copies.append(self._next_block(copies[-1] if copies else None))
                self.ref_count[copies[-1]] = 1
            request.block_ids = copies
            request.block_copies = list(zip(hits, request.block_ids))
            self._release(hits)
        else:
            request.block_ids = hits
        request.num_registered_blocks = len(hits)  # prefix hits are cached blocks already (copies stay private)
        num_hit = len(hits) * self.block_size
        self.prefix_queries += num_tokens
        self.prefix_hits += num_hit
        return num_hit

    def _worth_copying(self, hits: list[int]) -> bool:
        """Whether held hit blocks should be copied into a run of their own: not too many, not one run that
        the request's next block may continue, and enough free blocks for the copies."""
        if len(hits) > self.copy_hits_max_blocks or len(hits) > self.num_free_blocks:
            return False
        one_run = all(b == a + 1 for a, b in zip(hits, hits[1:]))
        return not (one_run and self._after(hits[-1]) is not None)

    def _extend_hashes(self, request: Request, upto_tokens: int) -> None:
        """Make sure request.block_hashes covers every full block below `upto_tokens`."""
        bs = self.block_size
        while (len(request.block_hashes) + 1) * bs <= upto_tokens:
            i = len(request.block_hashes)
            parent = request.block_hashes[-1] if i else None
            extra = request.mm_inputs.block_extra_key(i * bs, (i + 1) * bs) if request.mm_inputs else b""
            salt = request.prefix_salt if i == 0 else None  # chained: every later block inherits it
            request.block_hashes.append(hash_block(parent, request.token_ids_slice(i * bs, (i + 1) * bs), extra, salt))

    def cache_full_blocks(self, request: Request) -> None:
        """Register the request's computed full blocks in the prefix cache (after each step)."""
        if not self.enable_prefix_caching:
            return
        num_full = min(min(request.num_computed_tokens, request.num_tokens) // self.block_size, len(request.block_ids))
        self._extend_hashes(request, num_full * self.block_size)
        # Only blocks that became full since the last call: this runs for every request every step.
        for i in range(request.num_registered_blocks, num_full):
            block = request.block_ids[i]
            if self.hash_of[block] is not None:
                continue
            h = request.block_hashes[i]
            if h in self._cached:  # same content already cached in another block: keep that one
                continue
            self.hash_of[block] = h
            self._cached[h] = block
        request.num_registered_blocks = max(request.num_registered_blocks, num_full)

    # ---- allocation ---------------------------------------------------------------------------
    def can_allocate(self, request: Request, num_new_tokens: int) -> bool:
        need = self.blocks_needed(request.num_computed_tokens + num_new_tokens) - len(request.block_ids)
        return need <= self.num_free_blocks

    def allocate(self, request: Request, num_new_tokens: int) -> bool:
        """Give the request enough blocks to hold num_computed + num_new tokens; False if not enough."""
        need = self.blocks_needed(request.num_computed_tokens + num_new_tokens) - len(request.block_ids)
        if need > self.num_free_blocks:
            return False
        for _ in range(need):
            block = self._next_block(request.block_ids[-1] if request.block_ids else None)
            self.ref_count[block] = 1
            request.block_ids.append(block)
        return True

    def _next_block(self, last: int | None) -> int:
        """A free block for a request whose last block is `last`: `last + 1` where the pool's policy allows it
        (see the module docstring), else the policy's choice."""
        after = None if last is None else self._after(last)
        if after is not None:
            if after in self._free:
                del self._free[after]
                self._evict(after)
                return after
            return self._fresh.popleft()
        if self._reusing():
            block, _ = self._free.popitem(last=False)  # least recently freed first
            self._evict(block)
            return block
        return self._fresh.popleft()

    def _reusing(self) -> bool:
        """Whether the policy hands out a freed block (rather than a never-used one) next."""
        over_reserve = self.keep_free is not None and len(self._free) > self.keep_free
        return bool(self._free) and (over_reserve or not self._fresh)

    def _after(self, last: int) -> int | None:
        """`last + 1` if a run may continue there: free, and taking it costs the policy nothing (a freed block
        evicted where the policy evicts anyway or that caches nothing, or the never-used block it hands out
        next); None otherwise, or without `prefer_runs`."""
        after = last + 1
        if not self.prefer_runs or after >= self.num_blocks or self.ref_count[after] != 0:
            return None
        reuse = self._reusing()
        if after in self._free and (reuse or self.hash_of[after] is None):
            return after
        if not reuse and self._fresh and self._fresh[0] == after:
            return after
        return None

    def free(self, request: Request) -> None:
        """Release every block of a finished, aborted or preempted request."""
        # Tail blocks first, so the end of a prefix is evicted before its beginning.
        self._release(reversed(request.block_ids))
        request.block_ids = []
        request.block_copies = []  # not yet sent to the worker: the blocks they filled are free again
        request.num_registered_blocks = 0

    def _release(self, blocks) -> None:
        for block in blocks:
            self.ref_count[block] -= 1
            assert self.ref_count[block] >= 0, f"double free of block {block}"
            if self.ref_count[block] == 0:
                self._free[block] = None

    def _take(self, block: int) -> None:
        if self.ref_count[block] == 0:
            del self._free[block]
        self.ref_count[block] += 1

    def _evict(self, block: int) -> None:
        h = self.hash_of[block]
        if h is not None:
            if self._cached.get(h) == block:
                del self._cached[h]
            self.hash_of[block] = None

    def reset_prefix_cache(self) -> None:
        """Forget every cached block that no request holds (blocks in use keep their hashes)."""
        for block in list(self._cached.values()):
            if self.ref_count[block] == 0:
                self._evict(block)

    # ---- self-check ---------------------------------------------------------------------------
    def check_integrity(self, requests: list[Request]) -> None:
        """Raise RuntimeError if the bookkeeping is inconsistent with the given live requests."""
        refs = [0] * self.num_blocks
        fresh = set(self._fresh)
        for request in requests:
            if len(set(request.block_ids)) != len(request.block_ids):
                raise RuntimeError(f"request {request.request_id} lists a block twice")
            for block in request.block_ids:
                if block == NULL_BLOCK:
                    raise RuntimeError(f"request {request.request_id} holds the null block")
                refs[block] += 1
        for block in range(1, self.num_blocks):
            if refs[block] != self.ref_count[block]:
                raise RuntimeError(f"block {block}: ref_count {self.ref_count[block]} but {refs[block]} holders")
            if (refs[block] == 0) != (block in self._free or block in fresh):
                raise RuntimeError(f"block {block}: free-list membership disagrees with ref_count")
            if block in self._free and block in fresh:
                raise RuntimeError(f"block {block} is both fresh and freed")
        if NULL_BLOCK in self._free or NULL_BLOCK in fresh or self.ref_count[NULL_BLOCK] != 0:
            raise RuntimeError("the null block was handed out")
        for h, block in self._cached.items():
            if self.hash_of[block] != h:
                raise RuntimeError(f"prefix cache entry points at block {block} with another hash")
