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

JSON's free whitespace is bounded here, on the mask: once a JSON-kind sequence ends in
MAX_JSON_WHITESPACE whitespace characters, its row also forbids the tokens that are whitespace only
(unless nothing else is allowed), so the next token moves the JSON on. The grammar itself leaves
whitespace unbounded, which keeps each row's fill cheap (grammars.MAX_JSON_WHITESPACE says why).
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import threading
from collections import OrderedDict
from typing import Any

import numpy as np
import torch

from pagoda.frontend.structured_output.grammars import JSON_KINDS, MAX_JSON_WHITESPACE, build_grammar, clean_error
from pagoda.frontend.structured_output.vocabulary import grammar_tokenizer_info
from pagoda.sampling_params import StructuredOutputsParams

logger = logging.getLogger("pagoda")

_CACHE_ENTRIES = 256  # compiled grammars kept (each a few hundred KB at a 150k vocabulary)
_JSON_WHITESPACE = b" \t\n\r"


class _Matcher:
    __slots__ = ("matcher", "accepted", "broken", "json_whitespace", "trailing_whitespace")

    def __init__(self, matcher: Any, json_whitespace: bool):
        self.matcher = matcher
        self.accepted = 0  # output tokens fed to the matcher so far
        self.broken = False
        self.json_whitespace = json_whitespace  # the whitespace bound applies
        self.trailing_whitespace = 0  # whitespace characters the output ends in


class WhitespaceTable:
    """Per token id: how many JSON whitespace characters its text ends in, whether it is nothing else,
    and the packed mask (the bitmask's format) of the tokens that are not whitespace only."""

    def __init__(self, decoded_vocab: list[bytes], vocab_size: int):
        trailing = np.zeros(vocab_size, dtype=np.int32)
        only = np.zeros(vocab_size, dtype=bool)
        for token_id, text in enumerate(decoded_vocab[:vocab_size]):
            if text:
                kept = len(text.rstrip(_JSON_WHITESPACE))
                trailing[token_id] = len(text) - kept
                only[token_id] = kept == 0
        self.trailing, self.only = trailing.tolist(), only.tolist()
        words = -(-vocab_size // 32)
        bits = np.zeros(words * 32, dtype=np.uint64)
        bits[:vocab_size] = ~only
        packed = (bits.reshape(words, 32) << np.arange(32, dtype=np.uint64)).sum(axis=1)
        self.not_only = torch.from_numpy(packed.astype(np.uint32).view(np.int32))


class GrammarManager:
    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        eos_token_ids: list[int],
        compile_threads: int = 2,
        pin_memory: bool = False,
    ):
        """pin_memory: the bitmasks live in page-locked memory, so the sampler's copy to the GPU is
        asynchronous (from pageable memory it would block the host until the step's forward pass ends)."""
        self.vocab_size = vocab_size
        self.pin_memory = pin_memory
        self.eos_token_ids = sorted(eos_token_ids)
        self._executor = cf.ThreadPoolExecutor(max_workers=compile_threads, thread_name_prefix="pagoda-grammar")
        # The vocabulary's byte table takes seconds (150k tokens, Python holding the GIL): built once, on this
        # pool's thread, from construction; the engine waits for it before it serves (`wait_ready`).
        self._compiler = self._executor.submit(self._make_compiler, tokenizer)
        self._cache: OrderedDict[tuple[str, str, bool], cf.Future] = OrderedDict()
        self._lock = threading.Lock()
        self._matchers: dict[str, _Matcher] = {}
        self._whitespace: WhitespaceTable | None = None  # with the compiler

    def _make_compiler(self, tokenizer: Any) -> Any:
        import xgrammar as xgr  # lazy: the grammar engine

        info = grammar_tokenizer_info(tokenizer, self.vocab_size, self.eos_token_ids)
        self._whitespace = WhitespaceTable(info.decoded_vocab, self.vocab_size)
        return xgr.GrammarCompiler(info, max_threads=2, cache_enabled=False)

    def wait_ready(self) -> None:
        """Until the vocabulary table is built. A tokenizer the grammar engine cannot read is logged here;
        the engine serves anyway, and each constrained request is refused with the reason."""
        error = self._compiler.exception()
        if error is not None:
            logger.warning("Structured output is unavailable: the grammar engine cannot read the tokenizer: %s", error)

    @property
    def ready(self) -> bool:
        """Whether the vocabulary table is built (the grammar compiler exists)."""
        return self._compiler.done()

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
    def start(self, request_id: str, compiled: Any, kind: str) -> None:
        """A matcher for one sequence; `kind`: its constraint's (`StructuredOutputsParams.kind`)."""
        import xgrammar as xgr  # lazy: the grammar engine

        self._matchers[request_id] = _Matcher(xgr.GrammarMatcher(compiled), kind in JSON_KINDS)

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

    def fill(
        self, request_ids: list[str], outputs: list[list[int]], proposals: list[list[int]] | None = None
    ) -> tuple[torch.Tensor, list[int]] | None:
        """The allowed tokens of each constrained row: (bitmask int32 [B, ceil(V/32)], constrained row
        indices), None when no row is constrained. Unconstrained rows are all ones (every token allowed).
        `outputs[i]`: row i's output tokens so far (all of them sampled and on the host).

        `proposals[i]`: row i's speculative proposals (K the longest). The bitmask then has K + 1 rows per
        row (row i's position j at i * (K + 1) + j): the tokens allowed after its output and its proposals
        0 .. j - 1, up to the first proposal the grammar refuses (that position's mask refuses it; the
        positions after it are never reached). The matcher is rolled back over the proposals afterwards.

        The rows are filled one after another on this thread: xgrammar's own batch fill
        (BatchGrammarMatcher, on its threads) measured several times slower per row than this loop, on
        2 and on 16 cores (benchmarks/profile/grammar_fill.py)."""
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
        positions = 1 + max(map(len, proposals), default=0) if proposals is not None else 1
        words = -(-self.vocab_size // 32)
        bitmask = torch.full((len(request_ids) * positions, words), -1, dtype=torch.int32, pin_memory=self.pin_memory)
        bounded: list[int] = []
        filled: list[int] = []
        for row, s in zip(rows, matchers):
            ahead = proposals[row] if proposals is not None else []
            saved_whitespace, taken = s.trailing_whitespace, 0
            for j in range(len(ahead) + 1):
                flat = row * positions + j
                filled.append(flat)
                self._fill_one(bitmask, flat, s, bounded)
                if j == len(ahead) or s.broken or s.matcher.is_terminated():
                    break
                if not self._accept(s, ahead[j]):
                    break  # this position's mask refuses it: verification stops here
                taken += 1
            if taken:
                s.matcher.rollback(taken)
                s.trailing_whitespace = saved_whitespace
        if bounded:
            self._end_whitespace(bitmask, bounded)
        return bitmask, filled

    def _fill_one(self, bitmask: torch.Tensor, flat: int, s: _Matcher, bounded: list[int]) -> None:
        if s.broken or s.matcher.is_terminated():
            self._only_eos(bitmask, flat)
            return
        s.matcher.fill_next_token_bitmask(bitmask, flat)
        if s.trailing_whitespace >= MAX_JSON_WHITESPACE and s.json_whitespace:
            bounded.append(flat)

    def _accept(self, state: _Matcher, token: int) -> bool:
        """Feed one token to the matcher (False, the matcher unchanged, if the grammar refuses it) and
        track the whitespace the output ends in."""
        if not state.matcher.accept_token(token):
            return False
        whitespace = self._whitespace
        if whitespace is not None and state.json_whitespace and token < self.vocab_size:
            trailing = whitespace.trailing[token]
            state.trailing_whitespace = trailing + state.trailing_whitespace if whitespace.only[token] else trailing
        return True

    def _advance(self, request_id: str, state: _Matcher, output: list[int]) -> None:
        while state.accepted < len(output) and not state.broken:
            token = output[state.accepted]
            state.accepted += 1
            if state.matcher.is_terminated():
                continue  # tokens after EOS (dropped by the scheduler): nothing left to match
            if not self._accept(state, token):
                logger.error("Request %s: the grammar did not accept sampled token %d; it ends now.", request_id, token)
                state.broken = True

    def _end_whitespace(self, bitmask: torch.Tensor, rows: list[int]) -> None:
        """Forbid the whitespace-only tokens in `rows`, except in a row where they are all the grammar
        allows (inside a string whose pattern asks for spaces, say): a mask is never left empty."""
        assert self._whitespace is not None
        index = torch.tensor(rows)
        masked = bitmask[index] & self._whitespace.not_only
        keep = masked.any(dim=1)
        bitmask[index[keep]] = masked[keep]

    def _only_eos(self, bitmask: torch.Tensor, row: int) -> None:
        bitmask[row].zero_()
        for token in self.eos_token_ids:
            if token < self.vocab_size:
                bit = 1 << (token % 32)
                bitmask[row, token // 32] |= bit - (1 << 32) if bit >= 1 << 31 else bit  # int32: bit 31 is the sign

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
