"""A prompt's text work (chat-template rendering, tokenization) without stalling the event loop.

One API process serves every connection from one event loop, so a request that makes it tokenize
20 MB stalls /health and every stream for as long as that takes (tens of seconds, GiBs of offsets).
Three defences, in order:
  1. The character bound: no token stands for more characters than the vocabulary's longest piece
     (`tokenizer.longest_token_chars`), so a prompt longer than `max_model_len` times that can never
     fit. It is refused (400 naming max_model_len) before any tokenizing.
  2. Short texts (most requests) are rendered and tokenized on the loop, where they cost less than the
     hop to a thread would (benchmarks/profile/api_burst.py); longer ones go to a small pool of this
     process's own, through Rust's `encode_batch`, which releases the GIL (`fast_encoder(..., release_gil=True)`).
  3. The budget: a request whose work has not finished within `budget_s` (waiting for a thread
     included) is answered 400 rather than held; its thread finishes the piece it is in and is free.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
from collections.abc import Callable
from typing import Any, TypeVar

from pagoda.errors import ContextLengthExceeded, InvalidRequest
from pagoda.frontend.tokenizer import fast_encoder, longest_token_chars

T = TypeVar("T")

INLINE_CHARS = 32 * 1024  # texts up to this size are rendered / tokenized on the event loop
THREADS = 2  # per API process: the work holds a core each, and the loop needs one too
BUDGET_S = 30.0


class PromptWork:
    """One API process's tokenizer work. `max_model_len`: the context the character bound is for."""

    def __init__(self, tokenizer: Any, max_model_len: int, budget_s: float = BUDGET_S, threads: int = THREADS):
        self.max_model_len = max_model_len
        self.budget_s = budget_s
        self.token_chars = longest_token_chars(tokenizer)  # None: no bound for this tokenizer
        self.max_chars = None if self.token_chars is None else self.token_chars * max_model_len
        self._encode = fast_encoder(tokenizer)
        self._encode_released = fast_encoder(tokenizer, release_gil=True)
        self._pool = cf.ThreadPoolExecutor(max_workers=threads, thread_name_prefix="pagoda-prompt")

    def check_chars(self, text: str, param: str) -> None:
        """400 for a text that cannot fit in the context whatever it tokenizes to."""
        if self.max_chars is not None and len(text) > self.max_chars:
            raise ContextLengthExceeded(
                f"This model's maximum context length is {self.max_model_len} tokens. However, your {param} "
                f"has {len(text)} characters, more than {self.max_model_len} tokens can hold (no token of this "
                f"model stands for more than {self.token_chars} characters). Please reduce the length of the "
                f"{param}.",
                param,
            )

    async def encode(self, text: str, add_special_tokens: bool, param: str = "prompt") -> list[int]:
        """Token ids of `text`, checked against the character bound first."""
        self.check_chars(text, param)
        if len(text) <= INLINE_CHARS:
            return self._encode(text, add_special_tokens)
        return await self.run(len(text), param, self._encode_released, text, add_special_tokens)

    async def encode_many(self, texts: list[str], add_special_tokens: bool, param: str = "prompt") -> list[list[int]]:
        """`encode` of each text; one trip to the pool for all of them when together they are long."""
        for text in texts:
            self.check_chars(text, param)
        size = sum(len(text) for text in texts)
        encode = self._encode if size <= INLINE_CHARS else self._encode_released
        return await self.run(size, param, lambda: [encode(text, add_special_tokens) for text in texts])

    async def run(self, size: int, param: str, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)`: on the loop when `size` (characters of input) is small, else on the pool within
        the budget."""
        if size <= INLINE_CHARS:
            return fn(*args)
        future = self._pool.submit(fn, *args)
        try:
            return await asyncio.wait_for(asyncio.wrap_future(future), self.budget_s)
        except asyncio.TimeoutError:
            future.cancel()  # still queued: never starts
            raise InvalidRequest(
                f"Preparing the {param} ({size} characters) took longer than the limit of {self.budget_s:g} s; "
                f"send a shorter {param}.",
                param,
            ) from None

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def text_size(value: Any) -> int:
    """Characters of text in a JSON-like value (strings in nested lists and objects, keys included)."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, dict):
        return sum(text_size(k) + text_size(v) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return sum(text_size(item) for item in value)
    return 0
