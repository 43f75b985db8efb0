"""What a chat or completion request asks beyond sampling: a structured-output constraint
(response_format, vLLM's structured_outputs and guided_* fields), tools (tools, tool_choice,
parallel_tool_calls), and vLLM's per-request options (request_id, cache_salt, priority, return_token_ids,
return_tokens_as_token_ids), checked and turned into what the engine and the response builders need.

Every mistake is a 400 naming the field: two constraints at once, a json_schema without a schema, a
tool_choice naming a function that is not in `tools`, "auto" on a server started without
--enable-auto-tool-choice, a field Pagoda does not implement (`protocol.REFUSED_FIELDS`).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from pagoda.engine.validation import check_priority
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


@dataclass(frozen=True)
class RequestOptions:
    """vLLM's per-request options. `base_id`: the client's request id (the X-Request-Id header, else the
    body's request_id, else random): the response id is `{prefix}-{base_id}`, as vLLM's; the engine's id
    adds a random suffix, so two requests that reuse one id never collide in the engine."""

    base_id: str
    cache_salt: str | None = None
    priority: int = 0
    return_token_ids: bool = False
    tokens_as_ids: bool = False  # return_tokens_as_token_ids: logprob tokens as "token_id:N"
    lora_request: Any = None  # lora.request.LoRARequest of the adapter the request's `model` names
    model: str | None = None  # the name responses carry when it is not the base model's (an adapter's)

    def response_id(self, prefix: str) -> str:
        return f"{prefix}-{self.base_id}"

    def engine_id(self, k: int | None = None) -> str:
        """The engine's id of this request's prompt `k` (None: its only one)."""
        part = "" if k is None else f"-{k}"
        return f"{self.base_id}{part}-{uuid.uuid4().hex[:12]}"

    def engine_kwargs(self) -> dict[str, Any]:
        """What `generate_batches` takes beyond the prompt: only what is set (an engine stand-in in tests
        need not know the options)."""
        kwargs: dict[str, Any] = {}
        if self.cache_salt is not None:
            kwargs["cache_salt"] = self.cache_salt
        if self.priority:
            kwargs["priority"] = self.priority
        if self.lora_request is not None:
            kwargs["lora_request"] = self.lora_request
        return kwargs


def request_options(
    req: p._SamplingFields, scheduling_policy: str, lora_modules: dict[str, Any] | None = None
) -> RequestOptions:
    """The request's options, checked: a priority other than 0 needs --scheduling-policy priority; a `model`
    that names an adapter of `lora_modules` runs with it."""
    check_priority(req.priority, scheduling_policy)
    lora = (lora_modules or {}).get(req.model or "")
    return RequestOptions(
        base_id=req.request_id or uuid.uuid4().hex,
        cache_salt=req.cache_salt,
        priority=req.priority,
        return_token_ids=bool(req.return_token_ids),
        tokens_as_ids=bool(req.return_tokens_as_token_ids),
        lora_request=lora,
        model=lora.lora_name if lora is not None else None,
    )


def logprob_token(token_id: int, decoded: str | None, as_ids: bool) -> str:
    """How a logprob entry names its token: its text, or "token_id:N" (return_tokens_as_token_ids, for
    tokens whose text is not valid UTF-8 on its own)."""
    return f"token_id:{token_id}" if as_ids else (decoded or "")


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


def check_tool_results(messages: list[p.ChatMessage]) -> None:
    """A tool message answers a call an earlier assistant message made: its `tool_call_id` must be the
    id of one of those calls (OpenAI answers 400 otherwise; a template would pair them wrongly)."""
    call_ids: set[str] = set()
    for i, message in enumerate(messages):
        extra = message.model_extra or {}
        if message.role == "assistant" and isinstance(extra.get("tool_calls"), list):
            call_ids.update(
                c["id"] for c in extra["tool_calls"] if isinstance(c, dict) and isinstance(c.get("id"), str)
            )
        elif message.role == "tool":
            call_id = extra.get("tool_call_id")
            if call_id not in call_ids:
                said = f"tool_call_id {call_id[:100]!r}" if isinstance(call_id, str) else "no tool_call_id"
                raise InvalidRequest(
                    f"messages[{i}] is a tool message with {said}, which answers no tool call of an earlier "
                    "assistant message: a tool message must carry the id of the call it answers.",
                    "messages",
                )


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
