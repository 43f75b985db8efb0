"""Tool-call formats: the text a model writes to call a function, parsed back into calls.

Two formats (`--tool-call-parser`):
  hermes (alias qwen): what the Qwen2 / Qwen2.5 / Qwen2-VL / Qwen3 and Hermes templates teach, one
      block per call, anywhere in the reply, text around them being the message content:
          <tool_call>
          {"name": "get_weather", "arguments": {"city": "Paris"}}
          </tool_call>
  json: for models whose template has no tool format (Yuan2, SmolLM2): the whole reply is one call
      object {"name": ..., "arguments": {...}} or a JSON array of them; any other reply is content.

A call's `arguments` is the raw JSON text of the model's "arguments" value (so the streamed fragments
add up to exactly the non-streamed string). `ToolCallStream` turns a growing reply into OpenAI's stream
deltas: content as it comes (holding back what may be the start of a call), then per call one delta
with its id and name and further deltas with pieces of its arguments.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

from pagoda.frontend.detokenizer import held_prefix_len

_DECODER = json.JSONDecoder()
_NAME = re.compile(r'"name"\s*:\s*"((?:[^"\\]|\\.)*)"')
_ARGUMENTS = re.compile(r'"(?:arguments|parameters)"\s*:\s*')


def new_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


@dataclass
class ParsedCall:
    name: str | None = None
    arguments: str = ""  # raw JSON text of the arguments value so far
    complete: bool = False  # the call's text is closed and its object parsed


@dataclass
class Parsed:
    """A reply split into content and calls; `pending` is held-back text that may still turn out to
    start a call (it is content if the reply ends there)."""

    content: str = ""
    calls: list[ParsedCall] = field(default_factory=list)
    pending: str = ""


def _scan_call(body: str) -> ParsedCall | None:
    """A (possibly unfinished) call object's name and arguments text; None once it cannot be one."""
    stripped = body.lstrip()
    if stripped and not stripped.startswith("{"):
        return None
    call = ParsedCall()
    name = _NAME.search(body)
    if name is not None:
        try:
            call.name = json.loads(f'"{name.group(1)}"')
        except ValueError:
            return None
    args = _ARGUMENTS.search(body)
    if args is not None:
        start = args.end()
        try:
            _, end = _DECODER.raw_decode(body, start)
            call.arguments = body[start:end]
        except ValueError:
            call.arguments = body[start:].rstrip()
    try:
        obj, end = _DECODER.raw_decode(stripped)
    except ValueError:
        return call
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or stripped[end:].strip():
        return None
    call.name = obj["name"]
    arguments = obj.get("arguments", obj.get("parameters", {}))
    if args is None or not call.arguments:
        call.arguments = json.dumps(arguments, ensure_ascii=False)
    call.complete = True
    return call


class HermesParser:
    name = "hermes"
    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def parse(self, text: str, final: bool = False) -> Parsed:
        out = Parsed()
        pos = 0
        content: list[str] = []
        while True:
            start = text.find(self.OPEN, pos)
            if start < 0:
                tail = text[pos:]
                hold = 0 if final else held_prefix_len(tail, (self.OPEN,))
                content.append(tail[: len(tail) - hold])
                out.pending = tail[len(tail) - hold :]
                break
            content.append(text[pos:start])
            body_start = start + len(self.OPEN)
            end = text.find(self.CLOSE, body_start)
            if end < 0:  # an open block: its tail may be the start of the closing tag
                body = text[body_start:]
                body = body[: len(body) - held_prefix_len(body, (self.CLOSE,))]
            else:
                body = text[body_start:end]
            call = _scan_call(body)
            if call is None or (end >= 0 and not call.complete) or (final and end < 0 and not call.complete):
                # Not a call after all (or a closed block that does not parse): the text stays content.
                if end < 0:
                    content.append(text[start:])
                    break
                content.append(text[start : end + len(self.CLOSE)])
                pos = end + len(self.CLOSE)
                continue
            out.calls.append(call)
            if end < 0:
                break
            pos = end + len(self.CLOSE)
        out.content = "".join(content).strip("\n") if out.calls else "".join(content)
        return out


class JsonParser:
    """The whole reply is a call object or an array of them."""

    name = "json"

    def parse(self, text: str, final: bool = False) -> Parsed:
        stripped = text.lstrip()
        if not stripped:
            return Parsed(pending=text) if not final else Parsed(content=text)
        if stripped[0] == "{":
            call = _scan_call(stripped)
            if call is not None and (call.complete or not final):
                return Parsed(
                    calls=[call] if call.name is not None or call.complete else [], pending="" if call.name else text
                )
            return Parsed(content=text)
        if stripped[0] == "[":
            return self._parse_array(text, stripped, final)
        return Parsed(content=text)

    def _parse_array(self, text: str, stripped: str, final: bool) -> Parsed:
        try:
            value = json.loads(stripped)
        except ValueError:
            value = None
        if value is not None:
            if (
                isinstance(value, list)
                and value
                and all(isinstance(v, dict) and isinstance(v.get("name"), str) for v in value)
            ):
                return Parsed(calls=self._elements(stripped, complete=True))
            return Parsed(content=text)
        if final:
            return Parsed(content=text)
        return Parsed(calls=self._elements(stripped, complete=False), pending=text)

    @staticmethod
    def _elements(array_text: str, complete: bool) -> list[ParsedCall]:
        calls, pos = [], 1
        while pos < len(array_text):
            while pos < len(array_text) and array_text[pos] in " \t\r\n,":
                pos += 1
            if pos >= len(array_text) or array_text[pos] == "]":
                break
            try:
                _, end = _DECODER.raw_decode(array_text, pos)
            except ValueError:
                call = _scan_call(array_text[pos:])
                if call is not None and call.name is not None:
                    calls.append(call)
                break
            call = _scan_call(array_text[pos:end])
            if call is None:
                break
            call.complete = True
            calls.append(call)
            pos = end
        return calls


PARSERS: dict[str, type[HermesParser] | type[JsonParser]] = {
    "hermes": HermesParser,
    "qwen": HermesParser,
    "json": JsonParser,
}


def get_parser(name: str) -> HermesParser | JsonParser:
    return PARSERS[name]()


@dataclass
class CallDelta:
    index: int
    id: str | None  # the first delta of a call carries its id, type and name
    name: str | None
    arguments: str


class ToolCallStream:
    """One streamed sample: feed the text generated so far, get (content delta, call deltas). What was
    sent is never taken back: content and arguments only ever grow by what follows what went out."""

    def __init__(self, parser: HermesParser | JsonParser):
        self.parser = parser
        self.text = ""
        self._content = ""  # content sent so far
        self._ids: list[str] = []
        self._arguments: list[str] = []  # arguments text sent so far, per call

    @property
    def call_ids(self) -> list[str]:
        return list(self._ids)

    def feed(self, delta: str, final: bool = False) -> tuple[str, list[CallDelta]]:
        self.text += delta
        parsed = self.parser.parse(self.text, final)
        content = ""
        if parsed.content.startswith(self._content):
            content, self._content = parsed.content[len(self._content) :], parsed.content
        deltas = []
        for index, call in enumerate(parsed.calls):
            if call.name is None:
                break
            if index == len(self._ids):
                self._ids.append(new_call_id())
                self._arguments.append("")
                deltas.append(CallDelta(index, self._ids[index], call.name, ""))
            sent = self._arguments[index]
            if len(call.arguments) > len(sent) and call.arguments.startswith(sent):
                deltas.append(CallDelta(index, None, None, call.arguments[len(sent) :]))
                self._arguments[index] = call.arguments
        return content, deltas
