"""User-facing sampling parameters of one request (`SamplingParams`).

Owns the fields, their defaults (the same as vLLM's), normalisation of loose inputs
(stop as str or list, top_k -1 meaning off) and validation: every bad value raises
`InvalidRequest` whose message names the field and the allowed range, and whose `param`
is the field name, so the server can answer 400 with the offending parameter.
The engine resolves `max_tokens=None` against max_model_len; the sampler reads the rest.
`StructuredOutputsParams` (vLLM's name) says which grammar constrains the output; its shape is checked
here, the grammar itself by the grammar engine (`frontend/structured_output`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from pagoda.errors import InvalidRequest

# Temperatures below this are greedy: dividing logits by ~0 would overflow to inf/nan.
GREEDY_TEMPERATURE_EPS = 1e-5
# Cap on top logprobs per token: bounds the [B, K] top-k work done every step.
MAX_LOGPROBS = 20
# Samples per prompt (OpenAI's cap): every one is a sequence in the engine and a set of buffers here.
MAX_N = 128
# Stop conditions are checked for every new token of every sequence: bound how many and how long.
# (OpenAI allows 4 stop strings; vLLM has no cap.)
MAX_STOP_STRINGS = 64
MAX_STOP_CHARS = 1024
MAX_STOP_TOKEN_IDS = 256
# logprob_token_ids: gathered for every step of the request, [B, L] on the device.
MAX_LOGPROB_TOKEN_IDS = 256
# The sampler computes in float32: a float knob must be a value float32 holds, or it becomes inf (1e308)
# or 0 (1e-300) on the device, where inf/inf and x/0 give NaN logits and the sampled token is garbage.
# Such values are refused (400), not clamped: 0 or a magnitude in [FLOAT32_TINY, FLOAT32_MAX].
FLOAT32_MAX = 3.4028234663852886e38
FLOAT32_TINY = 1.1754943508222875e-38  # smallest normal float32


def _is_int(v: object) -> bool:
    # bool is a subclass of int, but `n=True` is a client bug, not a count.
    return isinstance(v, int) and not isinstance(v, bool)


def _check_float(name: str, v: object) -> float:
    if _is_int(v):
        return float(v)  # type: ignore[arg-type]
    if not isinstance(v, float) or not math.isfinite(v):
        raise InvalidRequest(f"{name} must be a finite number, got {v!r}", param=name)
    return v


def _check_int(name: str, v: object) -> int:
    if not _is_int(v):
        raise InvalidRequest(f"{name} must be an integer, got {v!r}", param=name)
    return v  # type: ignore[return-value]


def _fail(name: str, rule: str, v: object) -> InvalidRequest:
    return InvalidRequest(f"{name} {rule}, got {v!r}", param=name)


_KINDS = ("json", "regex", "choice", "grammar", "structural_tag")  # besides json_object
# Bounds on a grammar's source: it is compiled against the whole vocabulary, per distinct source.
MAX_GRAMMAR_CHARS = 256 * 1024
MAX_CHOICES = 1024


@dataclass
class StructuredOutputsParams:
    """Exactly one constraint on the output, as vLLM's `StructuredOutputsParams`:

    json: a JSON schema (dict or its JSON text); json_object: any JSON object; regex: a regular
    expression the whole output matches; choice: the output is one of these strings; grammar: an EBNF
    (GBNF-style) grammar whose `root` rule the output matches. disable_any_whitespace: JSON without
    free whitespace between tokens (compact output)."""

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None  # xgrammar's structural tag (JSON text): how forced tool calls are written
    disable_any_whitespace: bool = False
    # The request field the constraint came in (for the 400's `param`): the server sets
    # "response_format" or "guided_json" ...; offline it is "structured_outputs".
    param: str = "structured_outputs"

    def __post_init__(self) -> None:
        given = [name for name in _KINDS if getattr(self, name) is not None]
        if self.json_object:
            given.append("json_object")
        if len(given) != 1:
            raise InvalidRequest(
                f"{self.param} needs exactly one of json, json_object, regex, choice, grammar; got "
                f"{', '.join(given) or 'none'}.",
                self.param,
            )
        if self.choice is not None:
            if not isinstance(self.choice, (list, tuple)) or not self.choice:
                raise _fail(self.param, "choice must be a non-empty list of strings", self.choice)
            if len(self.choice) > MAX_CHOICES:
                raise InvalidRequest(f"{self.param}: at most {MAX_CHOICES} choices, got {len(self.choice)}", self.param)
            if not all(isinstance(c, str) and c for c in self.choice):
                raise _fail(self.param, "choice must contain only non-empty strings", self.choice)
            self.choice = list(self.choice)
        for name in ("regex", "grammar", "structural_tag"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value.strip()):
                raise _fail(self.param, f"{name} must be a non-empty string", value)
        if self.json is not None and not isinstance(self.json, (str, dict)):
            raise _fail(self.param, "json must be a JSON schema (an object or its JSON text)", self.json)
        if len(self.source) > MAX_GRAMMAR_CHARS:
            raise InvalidRequest(
                f"{self.param}: the {self.kind} is {len(self.source)} characters; at most {MAX_GRAMMAR_CHARS} are "
                "allowed.",
                self.param,
            )

    @property
    def kind(self) -> str:
        """ "json", "json_object", "regex", "choice", "grammar" or "structural_tag"."""
        for name in _KINDS:
            if getattr(self, name) is not None:
                return name
        return "json_object"

    @property
    def source(self) -> str:
        """The constraint as one string (a JSON schema as canonical JSON text): with `kind` and
        `disable_any_whitespace`, the key of its compiled grammar."""
        import json as _json  # the field named json shadows the module in this class's namespace

        kind = self.kind
        if kind == "json":
            if isinstance(self.json, str):
                return self.json
            return _json.dumps(self.json, sort_keys=True, separators=(",", ":"))
        if kind == "choice":
            return _json.dumps(self.choice)
        if kind == "json_object":
            return ""
        return getattr(self, kind)

    @property
    def key(self) -> tuple[str, str, bool]:
        return self.kind, self.source, self.disable_any_whitespace


@dataclass
class SamplingParams:
    """How to pick the output tokens of one request; validated on construction."""

    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 (or -1 on input) = disabled
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None  # list[str] after __post_init__
    stop_token_ids: list[int] | None = None  # list[int] after __post_init__
    ignore_eos: bool = False
    max_tokens: int | None = 16  # None = up to max_model_len (engine resolves)
    min_tokens: int = 0
    logprobs: int | None = None  # top logprobs per output token; 0 = sampled token only
    # vLLM's: these tokens' logprobs at every output position, instead of the top `logprobs` (implies logprobs=0
    # when that is unset); the sampled token's logprob comes too.
    logprob_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        if _check_int("n", self.n) < 1:
            raise _fail("n", "must be >= 1", self.n)
        if self.n > MAX_N:
            raise _fail("n", f"must be <= {MAX_N}", self.n)
        for name in ("presence_penalty", "frequency_penalty"):
            self._check_range(name, lambda v: -2.0 <= v <= 2.0, "must be in [-2, 2]")
        self._check_range("repetition_penalty", lambda v: v > 0.0, "must be > 0")
        self._check_range("temperature", lambda v: v >= 0.0, "must be >= 0")
        self._check_range("top_p", lambda v: 0.0 < v <= 1.0, "must be in (0, 1]")
        if _check_int("top_k", self.top_k) < -1:
            raise _fail("top_k", "must be 0 or -1 (disabled) or >= 1", self.top_k)
        self.top_k = max(self.top_k, 0)  # one spelling of "off" downstream
        self._check_range("min_p", lambda v: 0.0 <= v <= 1.0, "must be in [0, 1]")
        if self.seed is not None:
            _check_int("seed", self.seed)
        if self.max_tokens is not None and _check_int("max_tokens", self.max_tokens) < 1:
            raise _fail("max_tokens", "must be >= 1", self.max_tokens)
        if _check_int("min_tokens", self.min_tokens) < 0:
            raise _fail("min_tokens", "must be >= 0", self.min_tokens)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise _fail("min_tokens", f"must be <= max_tokens={self.max_tokens}", self.min_tokens)
        if self.logprobs is not None:
            if _check_int("logprobs", self.logprobs) < 0:
                raise _fail("logprobs", "must be >= 0", self.logprobs)
            if self.logprobs > MAX_LOGPROBS:
                raise _fail("logprobs", f"must be <= {MAX_LOGPROBS}", self.logprobs)
        if self.logprob_token_ids is not None:
            ids = self.logprob_token_ids
            if not isinstance(ids, (list, tuple)) or not ids or not all(_is_int(t) and t >= 0 for t in ids):
                raise _fail("logprob_token_ids", "must be a non-empty list of token ids (integers >= 0)", ids)
            if len(ids) > MAX_LOGPROB_TOKEN_IDS:
                raise _fail("logprob_token_ids", f"must have at most {MAX_LOGPROB_TOKEN_IDS} ids", len(ids))
            self.logprob_token_ids = list(ids)
            if self.logprobs is None:
                self.logprobs = 0
        self.stop = self._normalise_stop(self.stop)
        self.stop_token_ids = self._normalise_stop_token_ids(self.stop_token_ids)
        so = self.structured_outputs
        if so is not None:
            if not isinstance(so, StructuredOutputsParams):
                raise _fail("structured_outputs", "must be a StructuredOutputsParams", so)
            # The grammar ends the output with EOS; both would need tokens the grammar forbids.
            if self.ignore_eos:
                raise InvalidRequest(
                    f"ignore_eos cannot be combined with {so.param}: the grammar ends with EOS.", so.param
                )
            if self.min_tokens:
                raise InvalidRequest(
                    f"min_tokens cannot be combined with {so.param}: a complete output may be shorter.", so.param
                )

    def _check_range(self, name: str, ok: Callable[[float], bool], rule: str) -> None:
        # Error shows the value as the user sent it ("got -1", not "got -1.0").
        raw = getattr(self, name)
        v = _check_float(name, raw)
        if not ok(v):
            raise _fail(name, rule, raw)
        if v and not FLOAT32_TINY <= abs(v) <= FLOAT32_MAX:
            raise _fail(
                name,
                f"must be 0 or of magnitude in [{FLOAT32_TINY:.4g}, {FLOAT32_MAX:.4g}] "
                "(the sampler computes in float32)",
                raw,
            )
        setattr(self, name, v)  # ints become floats so downstream tensors see one type

    @staticmethod
    def _normalise_stop(stop: object) -> list[str]:
        if stop is None:
            return []
        items = [stop] if isinstance(stop, str) else stop
        if not isinstance(items, (list, tuple)):
            raise _fail("stop", "must be a string or a list of strings", stop)
        if len(items) > MAX_STOP_STRINGS:
            raise InvalidRequest(f"stop must have at most {MAX_STOP_STRINGS} strings, got {len(items)}", param="stop")
        for s in items:
            if not isinstance(s, str) or not s:
                raise _fail("stop", "must contain only non-empty strings", s)
            if len(s) > MAX_STOP_CHARS:
                raise InvalidRequest(
                    f"stop strings must be at most {MAX_STOP_CHARS} characters long, got one of {len(s)}", param="stop"
                )
        return list(items)

    @staticmethod
    def _normalise_stop_token_ids(ids: object) -> list[int]:
        if ids is None:
            return []
        if not isinstance(ids, (list, tuple)):
            raise _fail("stop_token_ids", "must be a list of integers >= 0", ids)
        if len(ids) > MAX_STOP_TOKEN_IDS:
            raise InvalidRequest(
                f"stop_token_ids must have at most {MAX_STOP_TOKEN_IDS} ids, got {len(ids)}", param="stop_token_ids"
            )
        for t in ids:
            if not _is_int(t) or t < 0:
                raise _fail("stop_token_ids", "must contain only integers >= 0", t)
        return list(ids)

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE_EPS
