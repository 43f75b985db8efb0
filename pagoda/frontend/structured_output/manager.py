"""The engine core's grammar state: compiled grammars (shared, cached), one matcher per constrained
sequence, and the token bitmask of each step's constrained rows.

Life of a constrained request:
  1. `compile(params)`: a future of the compiled grammar, compiled by a worker thread (xgrammar
     releases the GIL while it compiles, so the engine loop keeps stepping) and cached by the
     constraint's key: requests with the same schema share one compile and one compiled grammar.
     The engine holds the request back from the scheduler until its future is done (`LLMEngine`).
  2. `start(request_id, compiled)`: a matcher for the sequence (each of `n` samples has its own).
  3. Every step the runner calls `fill(request_ids, outputs)` while the device computes the step's
     forward pass: each matcher first takes the tokens the sequence sampled since its last call
     (after a preemption the runner still has them), then writes its row of allowed tokens. The
     sampler applies the rows to the logits (`layers.sampler`), whole batch at once.
  4. `remove(request_id)` when the sequence ends.
A matcher that has accepted EOS allows only EOS (the request is ending); one that was handed a
token it does not accept (never, unless a bug) is logged and allows only EOS, so the request ends
rather than continuing unconstrained.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import os
import threading
from collections import OrderedDict
from typing import Any

import torch

from pagoda.frontend.structured_output.grammars import build_grammar, clean_error
from pagoda.frontend.structured_output.vocabulary import grammar_tokenizer_info
from pagoda.sampling_params import StructuredOutputsParams

logger = logging.getLogger("pagoda")

_CACHE_ENTRIES = 256  # compiled grammars kept (each a few hundred KB at a 150k vocabulary)
_BATCH_FILL_ROWS = 8  # from this many constrained rows on, xgrammar fills the rows on its own threads


class _Matcher:
    __slots__ = ("matcher", "accepted", "broken")

    def __init__(self, matcher: Any):
        self.matcher = matcher
        self.accepted = 0  # output tokens fed to the matcher so far
        self.broken = False


class GrammarManager:
    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: list[int], compile_threads: int = 2):
        self.vocab_size = vocab_size
        self.eos_token_ids = sorted(eos_token_ids)
        self._executor = cf.ThreadPoolExecutor(max_workers=compile_threads, thread_name_prefix="pagoda-grammar")
        # The vocabulary's byte table takes a second or two (150k tokens): built once, off the loop, at startup.
        self._compiler = self._executor.submit(self._make_compiler, tokenizer)
        self._cache: OrderedDict[tuple[str, str, bool], cf.Future] = OrderedDict()
        self._lock = threading.Lock()
        self._matchers: dict[str, _Matcher] = {}
        self._batch: Any = None  # xgrammar BatchGrammarMatcher, made on first use

    def _make_compiler(self, tokenizer: Any) -> Any:
        import xgrammar as xgr  # lazy: the grammar engine

        info = grammar_tokenizer_info(tokenizer, self.vocab_size, self.eos_token_ids)
        return xgr.GrammarCompiler(info, max_threads=2, cache_enabled=False)

    # ---- compile ------------------------------------------------------------------------------
    def compile(self, params: StructuredOutputsParams) -> cf.Future:
        """A future of the compiled grammar (raises `ValueError` with a one-line reason on failure)."""
        key = params.key
        with self._lock:
            future = self._cache.get(key)
            if future is not None:
                self._cache.move_to_end(key)
                return future
            future = self._executor.submit(self._compile, params)
            self._cache[key] = future
            while len(self._cache) > _CACHE_ENTRIES:
                self._cache.popitem(last=False)
        return future

    def _compile(self, params: StructuredOutputsParams) -> Any:
        compiler = self._compiler.result()
        try:
            return compiler.compile_grammar(build_grammar(params))
        except Exception as exc:
            with self._lock:  # a failure is not cached: the next request with this key tries again
                self._cache.pop(params.key, None)
            raise ValueError(getattr(exc, "message", None) or clean_error(exc)) from None

    # ---- sequences ----------------------------------------------------------------------------
    def start(self, request_id: str, compiled: Any) -> None:
        import xgrammar as xgr  # lazy: the grammar engine

        self._matchers[request_id] = _Matcher(xgr.GrammarMatcher(compiled))

    def remove(self, request_id: str) -> None:
        self._matchers.pop(request_id, None)

    def is_constrained(self, request_id: str) -> bool:
        return request_id in self._matchers

    def any_constrained(self, request_ids: list[str]) -> bool:
        matchers = self._matchers
        return bool(matchers) and any(rid in matchers for rid in request_ids)

    @property
    def num_sequences(self) -> int:
        return len(self._matchers)

    def fill(self, request_ids: list[str], outputs: list[list[int]]) -> tuple[torch.Tensor, list[int]] | None:
        """The allowed tokens of each constrained row: (bitmask int32 [B, ceil(V/32)], constrained row
        indices), None when no row is constrained. `outputs[i]`: row i's output tokens so far (all of
        them sampled and on the host)."""
        import xgrammar as xgr  # lazy: the grammar engine

        rows, matchers = [], []
        for row, request_id in enumerate(request_ids):
            state = self._matchers.get(request_id)
            if state is None:
                continue
            self._advance(request_id, state, outputs[row])
            rows.append(row)
            matchers.append(state)
        if not rows:
            return None
        bitmask = xgr.allocate_token_bitmask(len(request_ids), self.vocab_size)
        live = [(row, s) for row, s in zip(rows, matchers) if not s.broken and not s.matcher.is_terminated()]
        for row, s in zip(rows, matchers):
            if s.broken or s.matcher.is_terminated():
                self._only_eos(bitmask, row)
        if len(live) >= _BATCH_FILL_ROWS:
            if self._batch is None:
                self._batch = xgr.BatchGrammarMatcher(max_threads=min(4, os.cpu_count() or 1))
            self._batch.batch_fill_next_token_bitmask([s.matcher for _, s in live], bitmask, [r for r, _ in live])
        else:
            for row, s in live:
                s.matcher.fill_next_token_bitmask(bitmask, row)
        return bitmask, rows

    def _advance(self, request_id: str, state: _Matcher, output: list[int]) -> None:
        while state.accepted < len(output) and not state.broken:
            token = output[state.accepted]
            state.accepted += 1
            if state.matcher.is_terminated():
                continue  # tokens after EOS (dropped by the scheduler): nothing left to match
            if not state.matcher.accept_token(token):
                logger.error("Request %s: the grammar did not accept sampled token %d; it ends now.", request_id, token)
                state.broken = True

    def _only_eos(self, bitmask: torch.Tensor, row: int) -> None:
        bitmask[row].zero_()
        for token in self.eos_token_ids:
            if token < self.vocab_size:
                bit = 1 << (token % 32)
                bitmask[row, token // 32] |= bit - (1 << 32) if bit >= 1 << 31 else bit  # int32: bit 31 is the sign

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
