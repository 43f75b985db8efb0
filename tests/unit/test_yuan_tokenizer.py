"""Yuan2.0 tokenizer + chat format against the golden fixtures (tests/fixtures/yuan2-tokenizer)."""

from __future__ import annotations

import json
import random

import pytest

from pagoda.frontend.chat_template import render_chat
from pagoda.frontend.detokenizer import IncrementalDetokenizer
from pagoda.frontend.yuan_tokenizer import YUAN_CHAT_TEMPLATE, load_yuan_tokenizer
from tests.conftest import FIXTURES

_FIXTURES = FIXTURES / "yuan2-tokenizer"
_GOLDEN_PATH = _FIXTURES / "tokenization_golden.json"

GOLDEN = (
    json.loads(_GOLDEN_PATH.read_text(encoding="utf-8"))
    if _GOLDEN_PATH.is_file()
    else {"special_token_ids": {}, "encode": [], "chat": []}
)


@pytest.fixture(scope="module")
def tok():
    return load_yuan_tokenizer(_FIXTURES)


def test_load_from_model_file_and_folder(tok):
    t2 = load_yuan_tokenizer(_FIXTURES / "tokenizer.model")
    assert len(t2) == len(tok) == GOLDEN["len_tokenizer_after_add_tokens"] == 134958
    assert t2.chat_template == YUAN_CHAT_TEMPLATE


@pytest.mark.parametrize("token,token_id", sorted(GOLDEN["special_token_ids"].items()))
def test_special_token_ids(tok, token, token_id):
    assert tok.convert_tokens_to_ids(token) == token_id
    assert tok.convert_ids_to_tokens(token_id) == token


def test_eos_and_special_ids(tok):
    assert tok.eos_token == "<eod>"
    assert tok.eos_token_id == GOLDEN["stop_token_id"] == 77185
    special = set(tok.all_special_ids)
    assert 77185 in special
    for name in (
        "<sep>",
        "<pad>",
        "<mask>",
        "<predict>",
        "<FIM_SUFFIX>",
        "<FIM_PREFIX>",
        "<FIM_MIDDLE>",
        "<commit_before>",
        "<commit_msg>",
        "<commit_after>",
        "<jupyter_start>",
        "<jupyter_text>",
        "<jupyter_code>",
        "<jupyter_output>",
        "<empty_output>",
    ):
        assert GOLDEN["special_token_ids"][name] in special
    assert 2 not in special  # "</s>" is NOT the stop token for Yuan
    assert 77186 not in special  # "<n>" is an ordinary piece


def test_len_tokenizer(tok):
    assert len(tok) == GOLDEN["len_tokenizer_after_add_tokens"]


@pytest.mark.parametrize("case", GOLDEN["encode"], ids=lambda c: repr(c["text"])[:30])
def test_encode_golden(tok, case):
    for add_special in (True, False):  # no BOS/EOS either way
        assert tok.encode(case["text"], add_special_tokens=add_special) == case["ids"]
    assert tok.convert_ids_to_tokens(case["ids"]) == case["pieces"]
    assert tok.decode(case["ids"]) == case["decode"]


@pytest.mark.parametrize("case", GOLDEN["chat"], ids=lambda c: f"{len(c['messages'])}msgs")
def test_chat_golden(tok, case):
    prompt = render_chat(tok, case["messages"])
    assert prompt == case["prompt_text"]
    # No generation prompt beyond the trailing <sep>.
    assert render_chat(tok, case["messages"], add_generation_prompt=False) == case["prompt_text"]
    assert tok.encode(prompt, add_special_tokens=False) == case["ids"]
    assert tok.convert_ids_to_tokens(case["ids"]) == case["pieces"]


def test_chat_template_matches_hub_template(tok):
    """Our template renders like the one the Yuan2 chat checkpoints ship (which uses sep_token)."""
    hub = GOLDEN["chat_template_hf_hub"]["template"]
    msgs = [
        {"role": "system", "content": "  sys \n"},
        {"role": "user", "content": " u1 "},
        {"role": "assistant", "content": "a1\n"},
        {"role": "user", "content": "u2"},
    ]
    ours = render_chat(tok, msgs)
    assert ours == "sys\nu1<n>a1<n>u2<sep>"
    assert render_chat(tok, msgs, chat_template=hub) == ours


def test_newline_marker_vs_single_tokens(tok):
    assert tok.convert_ids_to_tokens(tok.encode("<n>", add_special_tokens=False)) == ["▁<", "n", ">"]
    assert tok.encode("你好<n>", add_special_tokens=False)[-3:] == [29966, 29876, 29958]
    assert tok.convert_ids_to_tokens(tok.encode("x<n>y", add_special_tokens=False)) == ["▁x", "<", "n", ">", "y"]
    assert tok.encode("<sep>", add_special_tokens=False) == [77187]
    assert tok.encode("<eod>", add_special_tokens=False) == [77185]
    # Text after a special token gets a fresh dummy prefix (legacy behaviour).
    assert tok.convert_ids_to_tokens(tok.encode("a<sep>b", add_special_tokens=False)) == ["▁a", "<sep>", "▁b"]
    # The model may emit the <n> piece itself; it decodes to the text "<n>".
    assert tok.decode([77186]) == "<n>"


def test_skip_special_tokens(tok):
    ids = GOLDEN["chat"][1]["ids"] + [77185]
    text = tok.decode(ids, skip_special_tokens=True)
    assert "<sep>" not in text and "<eod>" not in text
    assert text == "你好<n>你好！有什么可以帮你的吗？<n>介绍一下北京"


def _stream(tok, ids, **kwargs):
    detok = IncrementalDetokenizer(tok, [], **kwargs)
    pieces = []
    for token_id in ids:
        assert detok.update([token_id]) is None
        pieces.append(detok.get_delta())
    detok.finish()
    pieces.append(detok.get_delta())
    assert "".join(pieces) == detok.output_text
    return detok.output_text


@pytest.mark.parametrize("index", range(len(GOLDEN["encode"])))
def test_incremental_detokenization_skip_special(tok, index):
    ids = GOLDEN["encode"][index]["ids"]
    assert _stream(tok, ids) == tok.decode(ids, skip_special_tokens=True)


def test_incremental_detokenization_chat_and_emoji(tok):
    for ids in [c["ids"] for c in GOLDEN["chat"]] + [GOLDEN["encode"][-1]["ids"] * 3]:
        assert _stream(tok, ids) == tok.decode(ids, skip_special_tokens=True)
    # Without skipping, sequences free of special tokens also stream exactly.
    emoji = GOLDEN["encode"][-1]
    assert _stream(tok, emoji["ids"], skip_special_tokens=False) == emoji["decode"]


def test_serving_tokenizer_maps_the_newline_piece():
    """The engine loads Yuan with <n> (77186) decoded as a line break, skipped specials dropped —
    what the official servers' post-processing does; the reference tokenizer keeps "<n>"."""
    from pagoda.frontend.tokenizer import load_tokenizer
    from pagoda.models.source import ModelSource

    source = ModelSource(str(_FIXTURES), "hf", {"model_type": "yuan", "architectures": ["YuanForCausalLM"]})
    serving = load_tokenizer(source, str(_FIXTURES))
    reference = load_yuan_tokenizer(_FIXTURES)
    # What a chat model emits: "<sep>" first, an answer over two lines, then "<eod>".
    answer = [77187] + serving.encode("第一行") + [77186] + serving.encode("line two") + [77185]
    assert serving.decode(answer, skip_special_tokens=True) == "第一行\n line two"
    assert reference.decode(answer, skip_special_tokens=True) == "第一行<n> line two"
    assert _stream(serving, answer) == "第一行\n line two"


def test_cached_decode_tables_match_transformers(tok):
    """The cached special/added-token tables give what transformers' own code gives, on random
    windows of real pieces, special tokens, added tokens and the <n> piece."""
    from transformers.tokenization_python import PreTrainedTokenizer

    rng = random.Random(7)
    pool = list(range(0, 300)) + list(tok.all_special_ids) + [77186] + list(tok._added_tokens_decoder)
    for _ in range(400):
        ids = [rng.choice(pool) if rng.random() < 0.3 else rng.randrange(len(tok)) for _ in range(rng.randint(1, 8))]
        for skip in (False, True):
            assert tok.convert_ids_to_tokens(ids, skip) == PreTrainedTokenizer.convert_ids_to_tokens(tok, ids, skip)
            tok.__dict__.pop("_pagoda_decode_tables", None)  # rebuilt from scratch: same text
            fresh = tok.decode(ids, skip_special_tokens=skip)
            assert tok.decode(ids, skip_special_tokens=skip) == fresh
    # Adding a special token rebuilds the tables (a private copy: the fixture is shared).
    tok = load_yuan_tokenizer(_FIXTURES)
    before = tok.decode([5, 6], skip_special_tokens=True)
    tok.add_special_tokens({"additional_special_tokens": ["<pagoda_test>"]})
    new_id = tok.convert_tokens_to_ids("<pagoda_test>")
    assert tok.decode([5, new_id, 6], skip_special_tokens=True) == before


def test_vocabulary_is_the_base_classes_also_after_adding_tokens():
    """`get_vocab` (pieces read in one call and kept) gives what transformers' SentencePiece backend gives: every
    entry in the same order, and the tokens added later too (a private copy: the fixture is shared)."""
    from transformers.tokenization_utils_sentencepiece import SentencePieceBackend

    tok = load_yuan_tokenizer(_FIXTURES)
    assert list(tok.get_vocab().items()) == list(SentencePieceBackend.get_vocab(tok).items())
    assert len(tok.get_vocab()) == len(tok) == 134958
    tok.add_tokens(["<pagoda_plain>"])
    tok.add_special_tokens({"additional_special_tokens": ["<pagoda_test>"]})
    vocab = tok.get_vocab()
    assert list(vocab.items()) == list(SentencePieceBackend.get_vocab(tok).items())
    assert vocab["<pagoda_test>"] == tok.convert_tokens_to_ids("<pagoda_test>") == 134959


@pytest.mark.parametrize("newline_as_text", [False, True])
def test_fast_decode_equals_decode(newline_as_text):
    """The detokenizer's shortcut (`fast_decode`) against the tokenizer's own `decode`, on random
    windows mixing ordinary pieces, byte pieces, <n>, special and added tokens, with every flag."""
    tok = load_yuan_tokenizer(_FIXTURES)
    tok.newline_token_as_text = newline_as_text
    rng = random.Random(11)
    byte_pieces = [tok.sp_model.PieceToId(f"<0x{b:02X}>") for b in (0x0A, 0xE4, 0xBD, 0xA0, 0xF0, 0x9F)]
    pool = [77186] * 5 + byte_pieces + list(tok.all_special_ids) + list(tok._added_tokens_decoder)
    checked_fast = 0
    for _ in range(600):
        ids = [rng.choice(pool) if rng.random() < 0.25 else rng.randrange(len(tok)) for _ in range(rng.randint(0, 7))]
        for skip in (False, True):
            for spaces in (True, False):
                want = tok.decode(ids, skip_special_tokens=skip, spaces_between_special_tokens=spaces)
                assert tok.fast_decode(ids, skip, spaces) == want, (ids, skip, spaces)
        checked_fast += all(i not in tok._added_tokens_decoder for i in ids)
    assert checked_fast > 100  # most windows took the shortcut, not the fallback
    # The detokenizer picks it up, and streams the same text as one full decode.
    ids = [rng.randrange(3, 60000) for _ in range(40)] + [77186, 5, 6]
    assert _stream(tok, ids) == tok.decode(ids, skip_special_tokens=True)
