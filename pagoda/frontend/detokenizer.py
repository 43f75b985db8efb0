"""Incremental detokenization and stop-string detection for one request.

Owns the translation of a request's output token ids, as they arrive step by step, into
streamable text deltas, plus the search for the request's stop strings in that text.

Text is produced with the "prefix/read offset" scheme: we keep a small window of recent
token ids, decode it twice (without and with the tokens not yet turned into text) and emit
the difference. Decoding a window, never the whole output, keeps each token O(window).
Decoding a few tokens *before* the new ones (instead of the new ones alone) is what makes
context-sensitive decoders right: SentencePiece drops the leading space of the first piece
it decodes, and byte-level BPE tokens may each carry only part of a UTF-8 character.

Two things are held back from the stream:
  * text whose decode ends in U+FFFD: the last token(s) hold an incomplete UTF-8 sequence
    that the next token will probably complete. They are released by a later token or by
    `finish()` (which then emits whatever the full decode has, U+FFFD included);
  * the longest suffix of the text that is a proper prefix of some stop string (at most
    len(longest stop) - 1 chars), since it may still turn into a stop string that must not
    reach the client. Released once it can no longer match, or on finish.

The tokenizer is duck-typed: it needs `decode(ids, skip_special_tokens=..., **kwargs)`
with `transformers` semantics; `all_special_ids` and `added_tokens_decoder` are used, when
present, to find the special tokens that skip_special_tokens drops, and `len()` to find the ids it
has no piece for: those (rows the checkpoint's embedding has past the tokenizer) decode to "" here
and in `decode_ids`, instead of raising inside the engine.

Speed: a decoding request costs two window decodes per token, every step, for every request.
For a stock `transformers` fast tokenizer (no decode override, no clean-up of tokenization
spaces) they go straight to its Rust `tokenizers.Tokenizer.decode`, which is what
`tokenizer.decode` ends up calling anyway, minus its Python argument handling on every call,
and the one-token context window's text comes from a per-tokenizer cache.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Any

# The decoder's replacement character: a decode ending in it means the window ends inside a
# UTF-8 sequence (or, rarely, the model really produced U+FFFD; then we just emit it late).
_REPLACEMENT = "\ufffd"

# How many prompt tokens seed the decode window, so the first output token is decoded in
# context (e.g. SentencePiece keeps its leading space).
_PROMPT_CONTEXT_TOKENS = 5

# Drop already-consumed ids from the front of the window list once this many pile up, so
# memory stays O(window) while the list operation stays amortised O(1) per token.
_TRIM_THRESHOLD = 256

# tokenizer -> ids that decode(skip_special_tokens=True) drops. Weak keys: tokenizers live as
# long as their engine, but tests build many and must not leak them.
_SKIPPABLE_CACHE: weakref.WeakKeyDictionary[Any, frozenset[int]] = weakref.WeakKeyDictionary()


def _skippable_special_ids(tokenizer: Any) -> frozenset[int]:
    """Ids that `tokenizer.decode(..., skip_special_tokens=True)` removes.

    We drop them before they enter the decode window (decode would skip them anyway) so
    that the prompt context is made of real text: a prompt ending in several specials
    (BOS/EOS, chat markers) would otherwise leave an all-special window, and SentencePiece
    would then strip the first output piece's leading space. Candidates come from the
    tokenizer's special/added token tables; each is confirmed by decoding it, so the set
    never contains an id that contributes text to the reference full decode.
    """
    try:
        return _SKIPPABLE_CACHE[tokenizer]
    except (KeyError, TypeError):
        pass
    candidates: set[int] = set(getattr(tokenizer, "all_special_ids", None) or ())
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    candidates.update(tid for tid, tok in added.items() if getattr(tok, "special", True))
    skippable = frozenset(tid for tid in candidates if tokenizer.decode([tid], skip_special_tokens=True) == "")
    try:
        _SKIPPABLE_CACHE[tokenizer] = skippable
    except TypeError:  # not weak-referenceable: recompute per request, still correct
        pass
    return skippable


# tokenizer -> how many ids it can decode (ids 0 .. n-1). A checkpoint's embedding often has more rows
# than its tokenizer has pieces (Yuan2: 135,040 rows, 134,958 pieces; Qwen2 pads to a multiple of
# 128): the model can sample such an id and a client can send one, but no tokenizer has text for it.
_PIECE_COUNT_CACHE: weakref.WeakKeyDictionary[Any, int | None] = weakref.WeakKeyDictionary()


def piece_count(tokenizer: Any) -> int | None:
    """How many ids `tokenizer` has text for (`len(tokenizer)`: its vocabulary plus added tokens),
    or None when it cannot say. Ids at or past it have no piece: they decode to "" everywhere
    (`decodable_ids`), whatever the tokenizer would do with them (SentencePiece raises)."""
    try:
        return _PIECE_COUNT_CACHE[tokenizer]
    except (KeyError, TypeError):
        pass
    try:
        count: int | None = int(len(tokenizer))
    except Exception:  # noqa: BLE001 - a tokenizer without a length: decode whatever comes
        count = None
    try:
        _PIECE_COUNT_CACHE[tokenizer] = count
    except TypeError:
        pass
    return count


def decodable_ids(tokenizer: Any, token_ids: Sequence[int]) -> list[int]:
    """`token_ids` without the ids the tokenizer has no piece for (negative, or >= `piece_count`)."""
    count = piece_count(tokenizer)
    ids = list(token_ids)
    if count is None:
        return [t for t in ids if t >= 0] if ids and min(ids) < 0 else ids
    if ids and (max(ids) >= count or min(ids) < 0):
        return [t for t in ids if 0 <= t < count]
    return ids


def decode_ids(tokenizer: Any, token_ids: Sequence[int], **kwargs: Any) -> str:
    """`tokenizer.decode(token_ids, **kwargs)`, with ids that have no piece decoding to ""."""
    return tokenizer.decode(decodable_ids(tokenizer, token_ids), **kwargs)


def held_prefix_len(text: str, markers: list[str] | tuple[str, ...]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of one of `markers`: text that
    must be held back from a stream because the next tokens may complete a marker (a stop string, a
    tool-call tag)."""
    best = 0
    for marker in markers:
        for k in range(min(len(marker) - 1, len(text)), best, -1):
            if text.endswith(marker[:k]):
                best = k
                break
    return best


class _FastDecoder:
    """`tokenizer.decode(ids, skip_special_tokens=...)` through the backend's Rust decoder, plus a
    cache of single-token decodes (the steady-state context window is one token; a decode is a
    pure function of the ids, so the cached text is exactly what decoding again would give)."""

    __slots__ = ("decode", "single")

    def __init__(self, raw: Callable[..., str], skip_special_tokens: bool):
        self.decode: Callable[[list[int]], str] = functools.partial(raw, skip_special_tokens=skip_special_tokens)
        self.single: dict[int, str] = {}


# tokenizer -> {skip_special_tokens: _FastDecoder or None (use tokenizer.decode)}.
_FAST_DECODE_CACHE: weakref.WeakKeyDictionary[Any, dict[tuple[bool, bool], _FastDecoder | None]] = (
    weakref.WeakKeyDictionary()
)


def _fast_decoder(
    tokenizer: Any, skip_special_tokens: bool, spaces_between_special_tokens: bool = True
) -> _FastDecoder | None:
    """A decoder equivalent to `tokenizer.decode(ids, skip_special_tokens=...)` that skips its
    Python layers, when that is provably the same function; None otherwise (custom tokenizers,
    overridden or patched decode methods, clean_up_tokenization_spaces, no fast tokenizer).
    A tokenizer may offer its own exact shortcut as `fast_decode(ids, skip_special_tokens,
    spaces_between_special_tokens)` (Yuan2's SentencePiece tokenizer does)."""
    try:
        per_tokenizer = _FAST_DECODE_CACHE.setdefault(tokenizer, {})
    except TypeError:  # not weak-referenceable
        per_tokenizer = {}
    key = (skip_special_tokens, spaces_between_special_tokens)
    if key in per_tokenizer:
        return per_tokenizer[key]
    own = getattr(tokenizer, "fast_decode", None)
    if callable(own):
        own_decoder = _FastDecoder(
            functools.partial(own, spaces_between_special_tokens=spaces_between_special_tokens), skip_special_tokens
        )
        per_tokenizer[key] = own_decoder
        return own_decoder
    fast: _FastDecoder | None = None
    try:
        from transformers import PreTrainedTokenizerFast  # lazy: transformers
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase  # lazy: transformers

        cls = type(tokenizer)
        backend: Any = getattr(tokenizer, "_tokenizer", None)
        if (
            isinstance(tokenizer, PreTrainedTokenizerFast)
            and cls.decode is PreTrainedTokenizerBase.decode
            and cls._decode is PreTrainedTokenizerFast._decode
            and "decode" not in vars(tokenizer)
            and "_decode" not in vars(tokenizer)
            and not getattr(tokenizer, "clean_up_tokenization_spaces", True)
            and callable(getattr(backend, "decode", None))
        ):
            fast = _FastDecoder(backend.decode, skip_special_tokens)
            # Belt and braces: the two must agree on a few ids (specials included) before use.
            probe = [[0], [1, 2, 3], list(getattr(tokenizer, "all_special_ids", None) or ())[:4] + [5]]
            if any(fast.decode(ids) != tokenizer.decode(ids, skip_special_tokens=skip_special_tokens) for ids in probe):
                fast = None
    except Exception:  # anything unexpected: the general path is always right
        fast = None
    per_tokenizer[key] = fast
    return fast


def single_token_decoder(tokenizer: Any) -> Callable[[int], str]:
    """`token_id -> tokenizer.decode([token_id])` (special tokens kept), e.g. for the text of logprob
    alternatives: a dict lookup after the first time, when the fast decoder applies."""
    fast = _fast_decoder(tokenizer, False)
    count = piece_count(tokenizer)
    if fast is None:
        return lambda token_id: decode_ids(tokenizer, [token_id])
    cache, decode = fast.single, fast.decode

    def token_text(token_id: int) -> str:
        if count is not None and not 0 <= token_id < count:
            return ""
        text = cache.get(token_id)
        if text is None:
            text = cache[token_id] = decode([token_id])
        return text

    return token_text


class IncrementalDetokenizer:
    """Turns a request's output token ids into text deltas as they arrive, and finds stop strings.

    Lifecycle: `update()` once per engine step with the step's new token ids, `get_delta()`
    whenever the caller wants to stream, and `finish()` when the request ends for a reason
    other than a stop string (length, EOS, abort). After `update()` has returned a stop
    string, or after `finish()`, the detokenizer is finished: `update()` must not be called
    again, nothing is held back, and `output_text` is final.

    Invariants:
      * output_text == "".join(every get_delta() result) + the text not yet fetched;
      * text returned by get_delta() is never later truncated by a stop string, and never
        ends in a partial UTF-8 sequence (unless finish() flushed one the model produced);
      * after finish() with no stop string, output_text equals
        decode_ids(tokenizer, output ids, skip_special_tokens=...) up to SentencePiece's leading
        space, which is decoded in the context of the prompt.
    """

    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: Sequence[int],
        *,
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
        stop: Iterable[str] = (),
        include_stop_str_in_output: bool = False,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._spaces_between_special_tokens = spaces_between_special_tokens
        fast = _fast_decoder(tokenizer, skip_special_tokens, spaces_between_special_tokens)
        self._decode: Callable[[list[int]], str] = fast.decode if fast is not None else self._decode_general
        self._single_token_text: dict[int, str] | None = fast.single if fast is not None else None
        self._skip_ids: frozenset[int] = _skippable_special_ids(tokenizer) if skip_special_tokens else frozenset()
        # Ids from here on have no piece: they add no text, like a skipped special token.
        self._num_pieces: int = piece_count(tokenizer) or (1 << 62)

        # Empty stop strings would match everywhere; duplicates only cost time.
        self._stops: tuple[str, ...] = tuple(dict.fromkeys(s for s in stop if s))
        self._include_stop = include_stop_str_in_output
        # Chars of already-appended text a new match may start in (len(stop) - 1 at most).
        self._tail_len = max((len(s) for s in self._stops), default=1) - 1

        # Decode window: ids[prefix_offset:read_offset] is text already emitted (decoded only
        # as context), ids[read_offset:] is not yet emitted. Invariant: the decode of
        # ids[prefix_offset:read_offset] does not end inside a UTF-8 sequence, so it is a
        # prefix of the decode of ids[prefix_offset:].
        context = self._prompt_context(prompt_token_ids)
        self._ids: list[int] = context
        self._prefix_offset = 0
        self._read_offset = len(context)
        self._prefix_text: str | None = None  # cached decode of ids[prefix_offset:read_offset]

        # Output text, split into what get_delta() already returned and what it has not.
        # Lists of parts (joined lazily) keep appends O(delta) for callers that never stream.
        self._delivered: list[str] = []
        self._pending: list[str] = []
        self._text_cache: str | None = ""
        # Last _tail_len chars of output text: where a stop string arriving next may begin.
        self._tail = ""

        self._finished = False
        self._stop_str: str | None = None

    # ------------------------------------------------------------------ public API

    def update(self, new_token_ids: Iterable[int]) -> str | None:
        """Append tokens; return the stop string matched (and truncate output_text accordingly) or None.

        Tokens after the one that completes a stop string are ignored: their text would be
        cut anyway. The stop string found is the one whose occurrence *ends* first in the
        text (ties: the one starting first), so the result does not depend on how tokens
        are batched into update() calls.
        """
        assert not self._finished, "update() after the request finished"
        for token_id in new_token_ids:
            stop = self.update_one(token_id)
            if stop is not None:
                return stop
        return None

    def update_one(self, token_id: int) -> str | None:
        """`update([token_id])`, without the iteration (the engine adds one token per step)."""
        assert not self._finished, "update() after the request finished"
        if token_id in self._skip_ids or not 0 <= token_id < self._num_pieces:
            return None
        self._ids.append(token_id)
        delta = self._decode_new(flush=False)
        if not delta:
            return None
        if self._stops:
            return self._append_text(delta)
        self._pending.append(delta)  # _push, inlined: this runs for every token
        self._text_cache = None
        return None

    def get_delta(self) -> str:
        """Text added since the previous get_delta() call that is safe to stream.

        Never ends inside a UTF-8 sequence and never contains text that may still become
        (part of) a stop string; both are released later or by finish().
        """
        pending = self._pending
        if not pending:
            return ""
        text = pending[0] if len(pending) == 1 else "".join(pending)
        hold = 0
        if self._stops and not (self._finished or self._include_stop):
            hold = self._stop_prefix_len(text)
        if hold:
            out = text[: len(text) - hold]
            self._pending = [text[len(text) - hold :]]
        else:
            out = text
            self._pending = []
        if out:
            self._delivered.append(out)
        return out

    @property
    def output_text(self) -> str:
        """Full text so far (after stop truncation); the final text once finished.

        Includes text get_delta() still holds back, but not the decode of trailing tokens
        that end inside a UTF-8 sequence (those appear after finish()). O(len(text)) the
        first time after each change, so read it at the end rather than every step.
        """
        if self._text_cache is None:
            self._text_cache = "".join(self._delivered) + "".join(self._pending)
        return self._text_cache

    @property
    def finished(self) -> bool:
        """True once a stop string matched or finish() was called."""
        return self._finished

    @property
    def stop_str(self) -> str | None:
        """The stop string that ended the request, if any."""
        return self._stop_str

    def finish(self) -> str | None:
        """End the request (length/EOS/abort): release all held-back text for get_delta.

        Tokens still waiting for the rest of a UTF-8 sequence are decoded as they are (so
        the text matches a full decode, U+FFFD included). That flushed text is still
        searched for stop strings; the matched one is returned (and recorded in
        `stop_str`), else None. Idempotent.
        """
        if self._finished:
            return None
        stop = None
        if self._read_offset < len(self._ids):
            delta = self._decode_new(flush=True)
            if delta:
                stop = self._append_text(delta)
        self._finished = True
        return stop

    # ------------------------------------------------------------------ decoding

    def _decode_general(self, ids: list[int]) -> str:
        return self._tokenizer.decode(
            ids,
            skip_special_tokens=self._skip_special_tokens,
            spaces_between_special_tokens=self._spaces_between_special_tokens,
        )

    def _prompt_context(self, prompt_token_ids: Sequence[int]) -> list[int]:
        """The last few (non-skipped) prompt ids, to seed the decode window."""
        context: list[int] = []
        for token_id in reversed(prompt_token_ids):
            if token_id in self._skip_ids or not 0 <= token_id < self._num_pieces:
                continue
            context.append(token_id)
            if len(context) == _PROMPT_CONTEXT_TOKENS:
                break
        context.reverse()
        # A prompt ending inside a UTF-8 sequence would break the window invariant (its
        # decode would not be a prefix of the decode with the output appended). Decode the
        # output on its own then: it starts with orphan continuation bytes, which is also
        # what a full decode of the output ids shows.
        if context and self._decode(context).endswith(_REPLACEMENT):
            return []
        return context

    def _decode_new(self, *, flush: bool) -> str:
        """Text of ids[read_offset:], or "" while it ends inside a UTF-8 sequence.

        With flush=True, emit it even then (the request is over; nothing will complete it).
        """
        ids, prefix_offset = self._ids, self._prefix_offset
        prefix_text = self._prefix_text
        if prefix_text is None:
            single = self._single_token_text
            if single is not None and self._read_offset - prefix_offset == 1:
                token_id = ids[prefix_offset]
                prefix_text = single.get(token_id)
                if prefix_text is None:
                    prefix_text = single[token_id] = self._decode([token_id])
            else:
                prefix_text = self._decode(ids[prefix_offset : self._read_offset])
            self._prefix_text = prefix_text
        new_text = self._decode(ids[prefix_offset:])
        # Not longer: the new token(s) produced no visible text yet (e.g. a lone SentencePiece
        # byte piece decodes to fewer chars than it will); keep them in the unread part.
        if len(new_text) <= len(prefix_text) or (not flush and new_text.endswith(_REPLACEMENT)):
            return ""
        # Advance: what was unread becomes the context of the next window.
        prefix_offset = self._prefix_offset = self._read_offset
        self._read_offset = len(ids)
        self._prefix_text = None
        if prefix_offset >= _TRIM_THRESHOLD:
            del ids[:prefix_offset]
            self._read_offset -= prefix_offset
            self._prefix_offset = 0
        return new_text[len(prefix_text) :]

    # ------------------------------------------------------------------ text + stop strings

    def _append_text(self, delta: str) -> str | None:
        """Add decoded text, searching the region where a new stop match can lie."""
        if not self._stops:
            self._push(delta)
            return None
        tail = self._tail
        window = tail + delta
        match = self._find_stop(window, len(tail))
        if match is None:
            self._push(delta)
            self._tail = window[max(0, len(window) - self._tail_len) :] if self._tail_len else ""
            return None
        start, stop = match
        keep = start + len(stop) if self._include_stop else start
        if keep >= len(tail):
            self._push(window[len(tail) : keep])
        else:
            # The stop began in text appended earlier; get_delta() held it back (it was a
            # prefix of this stop string), so it is still pending and can be removed.
            self._drop_last(len(tail) - keep)
        self._finished = True
        self._stop_str = stop
        return stop

    def _find_stop(self, window: str, new_from: int) -> tuple[int, str] | None:
        """Earliest-ending stop occurrence in `window` that ends after index `new_from`.

        Matches ending inside window[:new_from] were already looked for when that text
        arrived, so each stop is searched only from where it could reach the new text.
        Returns (start index in window, stop string).
        """
        best: tuple[int, int, str] | None = None  # (end, start, stop)
        for stop in self._stops:
            start = window.find(stop, max(0, new_from - len(stop) + 1))
            if start < 0:
                continue
            candidate = (start + len(stop), start, stop)
            if best is None or candidate[:2] < best[:2]:
                best = candidate
        return None if best is None else (best[1], best[2])

    def _stop_prefix_len(self, text: str) -> int:
        return held_prefix_len(text, self._stops)

    def _push(self, text: str) -> None:
        if text:
            self._pending.append(text)
            self._text_cache = None

    def _drop_last(self, n: int) -> None:
        """Remove the last n chars of output text; they must not have been delivered."""
        self._text_cache = None
        while n:
            assert self._pending, "stop truncation reached text already streamed"
            last = self._pending[-1]
            if len(last) <= n:
                self._pending.pop()
                n -= len(last)
            else:
                self._pending[-1] = last[: len(last) - n]
                n = 0
