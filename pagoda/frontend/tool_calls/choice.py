"""`tool_choice` made a guarantee: "required" or a named function becomes a grammar on the reply,
written in the tool-call format of the server's parser, so the reply is nothing but well-formed
calls of the allowed functions with arguments that match their JSON schemas.

hermes / qwen: one or more `<tool_call>` blocks (one with `parallel_tool_calls: false` or a named
function), each a call object whose "arguments" follows the function's parameters schema (an xgrammar
structural tag: literal text around JSON-schema content).
json: one call object, or with parallel calls a non-empty JSON array of them (a JSON schema).
"""

from __future__ import annotations

import json
from typing import Any

from pagoda.sampling_params import StructuredOutputsParams

# The json format's instructions, added as a system message when the model's chat template has no
# place for tools (it never mentions `tools`), so the model knows what it may call and how.
JSON_TOOLS_PROMPT = (
    "You can call functions. Their JSON signatures:\n{tools}\n\n"
    "To call one, reply with only a JSON object and nothing else: "
    '{{"name": <function name>, "arguments": <arguments object>}}'
    "{parallel}. Otherwise reply normally."
)


def parameters_schema(function: dict[str, Any]) -> dict[str, Any]:
    schema = function.get("parameters")
    return schema if isinstance(schema, dict) and schema else {"type": "object"}


def _call_schema(function: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {"name": {"const": function["name"]}, "arguments": parameters_schema(function)},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def forced_calls(
    parser: str, functions: list[dict[str, Any]], parallel: bool, param: str = "tool_choice"
) -> StructuredOutputsParams:
    """The constraint for tool_choice "required" (every function allowed) or a named one (`functions`
    is that one function; parallel is then False)."""
    if parser == "json":
        one = _call_schema(functions[0]) if len(functions) == 1 else {"anyOf": [_call_schema(f) for f in functions]}
        schema = {"type": "array", "minItems": 1, "items": one} if parallel else one
        return StructuredOutputsParams(json=schema, param=param)
    tags = [
        {
            "type": "tag",
            "begin": '<tool_call>\n{"name": ' + json.dumps(f["name"], ensure_ascii=False) + ', "arguments": ',
            "content": {"type": "json_schema", "json_schema": parameters_schema(f)},
            "end": "}\n</tool_call>",
        }
        for f in functions
    ]
    tag = {
        "type": "structural_tag",
        "format": {
            "type": "tags_with_separator",
            "tags": tags,
            "separator": "\n",
            "at_least_one": True,
            "stop_after_first": not parallel,
        },
    }
    return StructuredOutputsParams(structural_tag=json.dumps(tag), param=param)


def json_tools_prompt(functions: list[dict[str, Any]], parallel: bool) -> str:
    listing = "\n".join(json.dumps(f, ensure_ascii=False) for f in functions)
    return JSON_TOOLS_PROMPT.format(
        tools=listing, parallel=", or a JSON array of such objects to call several" if parallel else ""
    )
