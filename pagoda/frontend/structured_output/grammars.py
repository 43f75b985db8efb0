"""A request's constraint (`StructuredOutputsParams`) as an xgrammar `Grammar`, or a 400 naming the field.

Building the `Grammar` needs no tokenizer and takes milliseconds: the API process runs it on every
constrained request, so an invalid schema, regex or grammar is refused before it reaches the engine.
Compiling it against the vocabulary (the slow part) is the engine's (`manager.GrammarManager`).
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from typing import Any

from pagoda.errors import InvalidRequest
from pagoda.sampling_params import StructuredOutputsParams

# The longest run of whitespace JSON may have between two elements: room for a newline and indentation
# several levels deep, but not for the endless newlines a small model falls into when nothing stops it.
# Enforced on the mask (`manager.GrammarManager`), not in the grammar: xgrammar's own bound
# (max_whitespace_cnt) makes every whitespace token depend on the count, and a step's mask then costs
# several times as much (benchmarks/profile/grammar_fill.py).
MAX_JSON_WHITESPACE = 24
# The constraint kinds whose whitespace is JSON's (free between elements), where the bound applies.
JSON_KINDS = frozenset({"json", "json_object", "structural_tag"})
# xgrammar prefixes its C++ errors with "[hh:mm:ss] /path/file.cc:123: "; the rest is the useful part.
_CPP_PREFIX = re.compile(r"^\[[0-9:]+\]\s+\S+:\d+:\s*")


def clean_error(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return _CPP_PREFIX.sub("", text)


def choice_ebnf(choices: list[str]) -> str:
    """root ::= "a" | "b" ...: json.dumps writes each as an EBNF string literal (\\" \\\\ \\n \\uXXXX escapes)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def parse_schema(params: StructuredOutputsParams) -> dict[str, Any] | bool:
    """The JSON schema of a `json` constraint, checked against its meta-schema."""
    schema: Any = params.json
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as exc:
            raise InvalidRequest(f"{params.param}: the JSON schema is not valid JSON ({exc}).", params.param) from None
    if not isinstance(schema, (dict, bool)):
        raise InvalidRequest(
            f"{params.param}: a JSON schema must be an object, got {type(schema).__name__}.", params.param
        )
    import jsonschema  # lazy: only constrained requests need it

    try:
        jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator).check_schema(schema)
    except jsonschema.SchemaError as exc:
        where = "/".join(str(p) for p in exc.absolute_path) or "(root)"
        raise InvalidRequest(f"{params.param}: invalid JSON schema at {where}: {exc.message}.", params.param) from None
    return schema


def build_grammar(params: StructuredOutputsParams) -> Any:
    """The xgrammar `Grammar` of a constraint; `InvalidRequest` (param = the request field) when the
    schema, regex or grammar is malformed or uses what xgrammar cannot express."""
    import xgrammar as xgr  # lazy: the grammar engine loads only for constrained requests

    kind = params.kind
    any_whitespace = not params.disable_any_whitespace
    try:
        if kind == "json":
            schema = parse_schema(params)
            return xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=any_whitespace, strict_mode=True)
        if kind == "json_object":
            # OpenAI's json_object: an object, any keys and values (not strict: extra properties allowed).
            return xgr.Grammar.from_json_schema('{"type": "object"}', any_whitespace=any_whitespace, strict_mode=False)
        if kind == "choice":
            return xgr.Grammar.from_ebnf(choice_ebnf(params.choice or []))
        if kind == "regex":
            return xgr.Grammar.from_regex(params.source)
        if kind == "structural_tag":
            return xgr.Grammar.from_structural_tag(params.source)
        return xgr.Grammar.from_ebnf(params.source)
    except InvalidRequest:
        raise
    except Exception as exc:  # noqa: BLE001 - xgrammar reports every parse problem as RuntimeError/ValueError
        what = {"json": "JSON schema", "json_object": "JSON grammar", "choice": "choice list"}.get(kind, kind)
        raise InvalidRequest(f"{params.param}: the {what} cannot be used: {clean_error(exc)}", params.param) from None


_CHECKED_ENTRIES = 256
_checked: OrderedDict[tuple[str, str, bool], None] = OrderedDict()  # constraints that passed, newest last
_checked_lock = threading.Lock()


def check_structured_outputs(params: StructuredOutputsParams | None) -> None:
    """Refuse a malformed constraint (400) before the request is sent to the engine. A constraint that
    passed is remembered by its key: checking a JSON schema against its meta-schema takes milliseconds,
    which a batch of requests with one schema would otherwise pay on every request."""
    if params is None:
        return
    key = params.key
    with _checked_lock:
        if key in _checked:
            _checked.move_to_end(key)
            return
    build_grammar(params)
    with _checked_lock:
        _checked[key] = None
        while len(_checked) > _CHECKED_ENTRIES:
            _checked.popitem(last=False)
