"""Structured output and forced tool calls through the OpenAI API of the shared default-model server
(SmolLM2, whose chat template has no tool format: tool calls use the documented json format).

Outputs are checked with `jsonschema` and `re`, never with the grammar engine that produced them."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import pytest
from e2e_helpers import API_KEY, MODEL, assert_openai_error, sse_json, sse_payloads
from openai import OpenAI
from pydantic import BaseModel, Field

RECEIPT = [
    {"role": "user", "content": "Receipt: ACME Hardware, 2 hammers, total 19.00, paid by card. Give it as JSON."}
]
SCHEMA = {
    "type": "object",
    "properties": {
        "store": {"type": "string", "maxLength": 20},
        "total": {"type": "number", "minimum": 0, "maximum": 1000},
        "payment": {"enum": ["card", "cash"]},
    },
    "required": ["store", "total", "payment"],
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20}, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
        },
    },
}
ORDER = {
    "type": "function",
    "function": {
        "name": "lookup_order",
        "parameters": {
            "type": "object",
            "properties": {"order_id": {"type": "integer", "minimum": 1}},
            "required": ["order_id"],
        },
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def client(base_url: str) -> OpenAI:
    return OpenAI(base_url=f"{base_url}/v1", api_key=API_KEY, max_retries=0, timeout=120)


class Receipt(BaseModel):
    store: str = Field(max_length=20)
    total: float
    paid_by_card: bool


def test_sdk_parse_fills_a_pydantic_model(client: OpenAI) -> None:
    completion = client.beta.chat.completions.parse(
        model=MODEL, messages=RECEIPT, response_format=Receipt, max_tokens=120, temperature=0
    )
    message = completion.choices[0].message
    assert completion.choices[0].finish_reason == "stop", message.content
    assert isinstance(message.parsed, Receipt)
    assert Receipt.model_validate_json(message.content) == message.parsed


def test_json_schema_streamed_with_n_3(http: httpx.Client) -> None:
    body = {
        "model": MODEL,
        "messages": RECEIPT,
        "n": 3,
        "temperature": 1.0,
        "seed": 7,
        "max_tokens": 120,
        "stream": True,
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "receipt", "schema": SCHEMA, "strict": True},
        },
    }
    with http.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        chunks = sse_json(sse_payloads(response))
    texts, reasons = ["", "", ""], [None, None, None]
    for chunk in chunks:
        for choice in chunk["choices"]:
            texts[choice["index"]] += choice["delta"].get("content") or ""
            reasons[choice["index"]] = choice["finish_reason"] or reasons[choice["index"]]
    assert reasons == ["stop"] * 3, texts
    for text in texts:
        jsonschema.validate(json.loads(text), SCHEMA)


def test_completions_with_vllm_guided_fields(client: OpenAI) -> None:
    regex = r"[A-Z]{2}[0-9]{3}"
    out = client.completions.create(
        model=MODEL,
        prompt="Flight number:",
        max_tokens=12,
        n=3,
        temperature=1.0,
        seed=1,
        extra_body={"guided_regex": regex},
    )
    assert all(re.fullmatch(regex, c.text) for c in out.choices), [c.text for c in out.choices]
    out = client.completions.create(
        model=MODEL, prompt="Is the sky blue? Answer:", max_tokens=8, extra_body={"guided_choice": ["yes", "no"]}
    )
    assert out.choices[0].text in ("yes", "no")
    out = client.chat.completions.create(
        model=MODEL,
        messages=RECEIPT,
        max_tokens=120,
        temperature=0,
        extra_body={"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}},
    )
    text = out.choices[0].message.content
    jsonschema.validate(json.loads(text), SCHEMA)
    assert "\n" not in text


def test_named_tool_choice_forces_a_valid_call(client: OpenAI) -> None:
    out = client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        tools=[WEATHER, ORDER],
        max_tokens=80,
        temperature=0,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls", choice.message
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])


def test_required_tool_choice_streamed(client: OpenAI) -> None:
    stream = client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        tools=[WEATHER, ORDER],
        tool_choice="required",
        max_tokens=120,
        temperature=0,
        stream=True,
        parallel_tool_calls=False,
    )
    calls: dict[int, dict] = {}
    finish = None
    for chunk in stream:
        for choice in chunk.choices:
            for delta in choice.delta.tool_calls or []:
                call = calls.setdefault(delta.index, {"id": None, "name": None, "arguments": ""})
                if delta.id:
                    call["id"], call["name"] = delta.id, delta.function.name
                call["arguments"] += delta.function.arguments or ""
            finish = choice.finish_reason or finish
    assert finish == "tool_calls" and len(calls) == 1, calls
    call = calls[0]
    tool = {"get_weather": WEATHER, "lookup_order": ORDER}[call["name"]]
    jsonschema.validate(json.loads(call["arguments"]), tool["function"]["parameters"])


@pytest.mark.parametrize(
    "extra, param, words",
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 5}}}},
            "response_format",
            "invalid JSON schema",
        ),
        ({"response_format": {"type": "grammar"}}, "response_format", None),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            "response_format",
            "json_schema.schema",
        ),
        ({"guided_regex": "([a-z"}, "guided_regex", "regex cannot be used"),
        ({"guided_choice": ["a"], "guided_regex": "a"}, "guided_choice", "one output constraint"),
        ({"logit_bias": {"50256": -100}}, "logit_bias", "not supported"),
        ({"guided_decoding_backend": "outlines", "guided_choice": ["a"]}, "guided_decoding_backend", "xgrammar"),
        ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools", None),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
            "not in tools",
        ),
        ({"tools": [WEATHER]}, "tool_choice", "--enable-auto-tool-choice"),
        ({"tool_choice": "required"}, "tool_choice", "needs tools"),
        ({"tools": [WEATHER], "tool_choice": "required", "guided_json": SCHEMA}, "guided_json", "already constrains"),
    ],
)
def test_mistakes_are_400_naming_the_field(http: httpx.Client, extra: dict, param: str, words: str | None) -> None:
    for stream in (False, True):
        body = {"model": MODEL, "messages": ASK, "max_tokens": 4, "stream": stream, **extra}
        error = assert_openai_error(http.post("/v1/chat/completions", json=body), 400, contains=words)
        assert error["param"] is None or error["param"].startswith(param), error
