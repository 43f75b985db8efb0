"""Tool-call parsers on recorded model outputs: non-streamed parse, and the streamed deltas, which must
add up to the same calls however the text is cut into chunks."""

from __future__ import annotations

import json

import pytest

from pagoda.frontend.tool_calls.parsers import HermesParser, JsonParser, ToolCallStream, get_parser

pytestmark = pytest.mark.fast

# What Qwen2.5-7B-Instruct writes for two parallel calls (hermes format), with a sentence before them.
QWEN_TWO_CALLS = (
    "I'll look both up.\n<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n'
    "</tool_call>\n<tool_call>\n"
    '{"name": "get_time", "arguments": {"timezone": "Europe/Paris"}}\n'
    "</tool_call>"
)
# Hermes-2-Pro's order: arguments first, then the name.
HERMES_ARGS_FIRST = '<tool_call>\n{"arguments": {"q": "a \\"quoted\\" }"}, "name": "search"}\n</tool_call>'


def stream_all(parser_name: str, text: str, step: int) -> tuple[str, dict[int, dict]]:
    stream = ToolCallStream(get_parser(parser_name))
    content, calls = "", {}
    for start in range(0, len(text), step):
        piece = text[start : start + step]
        delta, deltas = stream.feed(piece, final=start + step >= len(text))
        content += delta
        for d in deltas:
            call = calls.setdefault(d.index, {"id": None, "name": None, "arguments": ""})
            if d.id is not None:
                assert call["id"] is None, "a call's id is sent once"
                call["id"], call["name"] = d.id, d.name
            call["arguments"] += d.arguments
    return content, calls


def test_hermes_two_calls_and_content() -> None:
    parsed = HermesParser().parse(QWEN_TWO_CALLS, final=True)
    assert parsed.content == "I'll look both up."
    assert [(c.name, json.loads(c.arguments)) for c in parsed.calls] == [
        ("get_weather", {"city": "Paris", "unit": "celsius"}),
        ("get_time", {"timezone": "Europe/Paris"}),
    ]


def test_hermes_arguments_before_name_and_braces_inside_strings() -> None:
    (call,) = HermesParser().parse(HERMES_ARGS_FIRST, final=True).calls
    assert call.name == "search" and json.loads(call.arguments) == {"q": 'a "quoted" }'}


@pytest.mark.parametrize("text", ["Just an answer.", "<tool_call>\nnot json\n</tool_call>", "a <tool_ca"])
def test_hermes_text_that_is_not_a_call_stays_content(text: str) -> None:
    parsed = HermesParser().parse(text, final=True)
    assert parsed.calls == [] and parsed.content == text


@pytest.mark.parametrize("step", [1, 2, 3, 7, 1000])
def test_hermes_stream_adds_up_to_the_parse(step: int) -> None:
    content, calls = stream_all("hermes", QWEN_TWO_CALLS, step)
    final = HermesParser().parse(QWEN_TWO_CALLS, final=True)
    assert content.strip() == final.content  # the content may keep the newline before the first call
    assert "<tool_call>" not in content
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [(c.name, c.arguments) for c in final.calls]
    assert len({c["id"] for c in calls.values()}) == 2


@pytest.mark.parametrize(
    "text, expected",
    [
        ('{"name": "lookup", "arguments": {"order": 42}}', [("lookup", {"order": 42})]),
        (
            ' [{"name": "a", "arguments": {}}, {"name": "b", "arguments": {"x": [1, 2]}}]',
            [("a", {}), ("b", {"x": [1, 2]})],
        ),
        ('{"name": "lookup", "parameters": {"order": 7}}', [("lookup", {"order": 7})]),
    ],
)
def test_json_format_calls(text: str, expected: list) -> None:
    parsed = JsonParser().parse(text, final=True)
    assert [(c.name, json.loads(c.arguments)) for c in parsed.calls] == expected and parsed.content == ""
    for step in (1, 4):
        content, calls = stream_all("json", text, step)
        assert content == "" and [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == expected


@pytest.mark.parametrize("text", ["The order shipped.", '{"answer": 42}', "[1, 2, 3]", '{"name": "x", "argu'])
def test_json_format_other_replies_are_content(text: str) -> None:
    assert JsonParser().parse(text, final=True).calls == []
    assert JsonParser().parse(text, final=True).content == text
    if "name" not in text:  # a call cut off by max_tokens has had its name streamed already
        content, calls = stream_all("json", text, 3)
        assert calls == {} and content == text
