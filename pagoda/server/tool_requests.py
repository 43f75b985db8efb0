"""What a chat or completion request asks beyond sampling: a structured-output constraint
(response_format, vLLM's structured_outputs and guided_* fields) and tools (tools, tool_choice,
parallel_tool_calls), checked and turned into what the engine and the response builders need.

Every mistake is a 400 naming the field: two constraints at once, a json_schema without a schema, a
tool_choice naming a function that is not in `tools`, "auto" on a server started without
--enable-auto-tool-choice, a field Pagoda does not implement (`protocol.REFUSED_FIELDS`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from pagoda.errors import InvalidRequest
from pagoda.frontend.structured_output.grammars import check_structured_outputs
from pagoda.frontend.tool_calls.choice import forced_calls, json_tools_prompt, parameters_schema
from pagoda.frontend.tool_calls.parsers import HermesParser, JsonParser, get_parser, new_call_id
from pagoda.sampling_params import StructuredOutputsParams
from pagoda.server import protocol as p

_GUIDED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")


def refuse_unimplemented(req: p._SamplingFields) -> None:
    extra = req.model_extra or {}
    for name, off in p.REFUSED_FIELDS.items():
        if name in extra and extra[name] is not None and extra[name] != off:
            raise InvalidRequest(f"{name} is not supported by this server; remove it from the request.", name)
    backend = req.guided_decoding_backend
    if backend is not None and backend not in ("auto", "xgrammar"):
        raise InvalidRequest(
            f"guided_decoding_backend {backend!r} is not available; this server uses xgrammar (or send 'auto').",
            "guided_decoding_backend",
        )


def structured_outputs_of(req: p._SamplingFields) -> StructuredOutputsParams | None:
    """The request's one output constraint, or None; checked (a malformed schema, regex or grammar is
    a 400 here, before the engine sees the request)."""
    found: list[StructuredOutputsParams] = []
    fmt = req.response_format
    if fmt is not None and fmt.type == "json_object":
        found.append(StructuredOutputsParams(json_object=True, param="response_format"))
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None or fmt.json_schema.schema_ is None:
            raise InvalidRequest(
                "response_format of type json_schema needs json_schema.schema (a JSON schema object).",
                "response_format",
            )
        schema = fmt.json_schema.schema_
        if isinstance(schema, bool):
            schema = {} if schema else {"not": {}}
        found.append(StructuredOutputsParams(json=schema, param="response_format"))
    if req.structured_outputs is not None:
        so = req.structured_outputs
        found.append(
            StructuredOutputsParams(
                json=so.json_,
                regex=so.regex,
                choice=so.choice,
                grammar=so.grammar,
                json_object=so.json_object or None,
                disable_any_whitespace=so.disable_any_whitespace,
                param="structured_outputs",
            )
        )
    for name in _GUIDED:
        value = getattr(req, name)
        if value is not None:
            kind = name.removeprefix("guided_")
            found.append(StructuredOutputsParams(**{kind: value}, param=name))
    if len(found) > 1:
        raise InvalidRequest(f"Send one output constraint, not {' and '.join(s.param for s in found)}.", found[1].param)
    result = found[0] if found else None
    check_structured_outputs(result)
    return result


@dataclass
class ToolPlan:
    """How a chat request's tools are offered and read back."""

    functions: list[dict[str, Any]]  # the tools' `function` objects, as sent
    choice: str  # "auto" | "required" | "named"
    parser: HermesParser | JsonParser
    parallel: bool
    forced: StructuredOutputsParams | None  # the grammar of "required" / a named function

    @property
    def template_tools(self) -> list[dict[str, Any]]:
        return [{"type": "function", "function": f} for f in self.functions]


def plan_tools(req: p.ChatCompletionRequest, auto_enabled: bool, parser_name: str | None) -> ToolPlan | None:
    """None: no tools, or tool_choice "none" (the tools are then left out of the prompt too)."""
    choice = req.tool_choice
    if not req.tools:
        if choice is not None and choice != "none":
            raise InvalidRequest("tool_choice needs tools: send the functions the model may call.", "tool_choice")
        return None
    if choice == "none":
        return None
    functions = [t.function.model_dump(exclude_none=True) for t in req.tools]
    names = [f["name"] for f in functions]
    if len(set(names)) != len(names):
        raise InvalidRequest("tools: two functions have the same name.", "tools")
    for f in functions:
        check_structured_outputs(StructuredOutputsParams(json=parameters_schema(f), param="tools"))
    parallel = req.parallel_tool_calls is not False
    if choice is None or choice == "auto":
        if not auto_enabled:
            raise InvalidRequest(
                'tool_choice "auto" (the default when tools are sent) needs a server started with '
                '--enable-auto-tool-choice and --tool-call-parser; or send tool_choice "required", a named '
                'function, or "none".',
                "tool_choice",
            )
        return ToolPlan(functions, "auto", get_parser(parser_name or "json"), parallel, None)
    fmt = parser_name or "json"
    if choice == "required":
        forced = forced_calls(fmt, functions, parallel)
        return ToolPlan(functions, "required", get_parser(fmt), parallel, forced)
    assert isinstance(choice, p.NamedToolChoice)
    named = [f for f in functions if f["name"] == choice.function.name]
    if not named:
        raise InvalidRequest(
            f"tool_choice names function {choice.function.name!r}, which is not in tools ({', '.join(names)}).",
            "tool_choice",
        )
    forced = forced_calls(fmt, named, False)
    return ToolPlan(functions, "named", get_parser(fmt), False, forced)


def template_mentions_tools(template: str | None) -> bool:
    return bool(template) and "tools" in template  # type: ignore[operator]


def prepare_messages(dicts: list[dict[str, Any]], plan: ToolPlan | None, template: str | None) -> list[dict[str, Any]]:
    """Messages as chat templates expect them: an assistant turn's tool-call arguments as objects (the
    Qwen and Llama templates write them with `tojson`; OpenAI sends JSON text); with the json format
    and a template that has no place for tools, the tools as a system message."""
    out = []
    for message in dicts:
        calls = message.get("tool_calls")
        if message.get("role") == "assistant" and isinstance(calls, list):
            fixed = []
            for call in calls:
                call = dict(call) if isinstance(call, dict) else call
                function = call.get("function") if isinstance(call, dict) else None
                if isinstance(function, dict) and isinstance(function.get("arguments"), str):
                    try:
                        arguments = json.loads(function["arguments"])
                    except ValueError:
                        raise InvalidRequest(
                            "messages: an assistant tool call's function.arguments is not valid JSON.", "messages"
                        ) from None
                    call["function"] = {**function, "arguments": arguments}
                fixed.append(call)
            message = {**message, "tool_calls": fixed}
        out.append(message)
    if plan is not None and plan.parser.name == "json" and not template_mentions_tools(template):
        prompt = json_tools_prompt(plan.functions, plan.parallel)
        if out and out[0].get("role") == "system" and isinstance(out[0].get("content"), str):
            out[0] = {**out[0], "content": out[0]["content"] + "\n\n" + prompt}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


def final_message(text: str, plan: ToolPlan | None, finish_reason: str | None) -> tuple[p.ResponseMessage, str | None]:
    """A finished sample's message (content and/or tool calls) and its finish_reason ("tool_calls"
    when it made calls and stopped on its own)."""
    if plan is None:
        return p.ResponseMessage(content=text), finish_reason
    parsed = plan.parser.parse(text, final=True)
    calls = [
        p.ToolCall(id=new_call_id(), function=p.FunctionCall(name=c.name, arguments=c.arguments))
        for c in parsed.calls
        if c.complete and c.name is not None
    ]
    if not calls:
        return p.ResponseMessage(content=text), finish_reason
    content = parsed.content.strip() or None
    return p.ResponseMessage(
        content=content, tool_calls=calls
    ), "tool_calls" if finish_reason == "stop" else finish_reason
