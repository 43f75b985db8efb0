"""`--speculative-config` / `LLM(speculative_config=...)`: vLLM's JSON object, the methods built here.

vLLM's keys are accepted by name; a method or key this engine does not implement is refused in one line that
names what is supported, never accepted and ignored.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from pagoda.errors import ConfigError
from pagoda.spec_decode.suffix import SuffixParams

METHODS = ("ngram", "suffix", "draft_model")
# vLLM's other methods, refused by name (with what is supported) rather than as unknown words.
KNOWN_ELSEWHERE = ("eagle", "eagle3", "medusa", "mlp_speculator", "mtp")
_COMMON = {"method", "num_speculative_tokens", "disable_by_batch_size"}
_KEYS = {
    "ngram": _COMMON | {"prompt_lookup_min", "prompt_lookup_max"},
    "suffix": _COMMON
    | {
        "suffix_decoding_max_tree_depth",
        "suffix_decoding_max_cached_requests",
        "suffix_decoding_max_spec_factor",
        "suffix_decoding_min_token_prob",
    },
    "draft_model": _COMMON | {"model", "draft_tensor_parallel_size"},
}
# vLLM's suffix defaults; num_speculative_tokens defaults to the tree depth there too.
SUFFIX_DEFAULTS = SuffixParams(max_tree_depth=24, max_cached_requests=10000, max_spec_factor=1.0, min_token_prob=0.1)
PARAM = "speculative_config"


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int  # k: proposals verified per request per step
    prompt_lookup_min: int  # n-gram lengths tried, longest first
    prompt_lookup_max: int
    disable_by_batch_size: int | None  # no proposals in steps with at least this many running requests
    suffix: SuffixParams | None = None  # method "suffix"
    draft_model: str | None = None  # method "draft_model": the draft's folder, hub id or .gguf


def parse_speculative_config(value: str | dict[str, Any] | None) -> SpeculativeConfig | None:
    """The config from a JSON string (the CLI) or a dict (the Python API); None when not given."""
    if value is None or value == "":
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ConfigError(
                f"--speculative-config is not valid JSON ({exc.msg} at column {exc.colno}).", PARAM
            ) from None
    if not isinstance(value, dict):
        raise ConfigError('--speculative-config must be a JSON object, e.g. \'{"method": "ngram", ...}\'.', PARAM)
    method = value.get("method")
    if method is None:
        raise ConfigError(f'--speculative-config needs "method" (supported: {", ".join(METHODS)}).', PARAM)
    if method not in METHODS:
        known = "vLLM's method " if method in KNOWN_ELSEWHERE else "method "
        raise ConfigError(
            f"--speculative-config {known}{method!r} is not supported; supported: {', '.join(METHODS)}.", PARAM
        )
    unknown = sorted(set(value) - _KEYS[method])
    if unknown:
        raise ConfigError(
            f"--speculative-config keys not supported for {method!r}: {', '.join(unknown)} "
            f"(supported: {', '.join(sorted(_KEYS[method]))}).",
            PARAM,
        )
    disable = _positive_int(value, "disable_by_batch_size", None)
    if method == "suffix":
        suffix = _suffix_params(value)
        k = _positive_int(value, "num_speculative_tokens", suffix.max_tree_depth)
        assert k is not None
        return SpeculativeConfig(method, k, 0, 0, disable, suffix)
    k = _positive_int(value, "num_speculative_tokens", None)
    if k is None:
        raise ConfigError('--speculative-config needs "num_speculative_tokens" (proposals per step, e.g. 4).', PARAM)
    if method == "draft_model":
        model = value.get("model")
        if not isinstance(model, str) or not model:
            raise ConfigError(
                '--speculative-config method "draft_model" needs "model": the draft model\'s folder or hub id.', PARAM
            )
        if value.get("draft_tensor_parallel_size", 1) != 1:
            raise ConfigError("--speculative-config draft_tensor_parallel_size: only 1 is supported.", PARAM)
        return SpeculativeConfig(method, k, 0, 0, disable, draft_model=model)
    # Our defaults: n-grams of 2 to 5 tokens (one repeated token is weak evidence: on open chat it proposed
    # 3x the tokens for a third more accepted, benchmarks/spec_decode_cpu.py); a lone bound keeps the other at
    # its default unless that would cross it (a max of 1 tries 1; a min of 7 tries just 7).
    given_low = _positive_int(value, "prompt_lookup_min", None)
    given_high = _positive_int(value, "prompt_lookup_max", None)
    low = given_low or min(2, given_high or 2)
    high = given_high or max(5, low)
    if low > high:
        raise ConfigError(f"prompt_lookup_min ({low}) must be <= prompt_lookup_max ({high}).", PARAM)
    return SpeculativeConfig(method, k, low, high, disable)


def _suffix_params(value: dict[str, Any]) -> SuffixParams:
    d = SUFFIX_DEFAULTS
    depth = _positive_int(value, "suffix_decoding_max_tree_depth", d.max_tree_depth)
    cached = value.get("suffix_decoding_max_cached_requests", d.max_cached_requests)
    if isinstance(cached, bool) or not isinstance(cached, int) or cached < 0:
        raise ConfigError(
            f"--speculative-config suffix_decoding_max_cached_requests must be an integer >= 0 (0: no cache), "
            f"got {cached!r}.",
            PARAM,
        )
    factor = _number(value, "suffix_decoding_max_spec_factor", d.max_spec_factor, "a number > 0", lambda x: x > 0)
    prob = _number(
        value, "suffix_decoding_min_token_prob", d.min_token_prob, "a number in [0, 1]", lambda x: 0 <= x <= 1
    )
    assert depth is not None
    return SuffixParams(depth, cached, factor, prob)


def _number(value: dict[str, Any], key: str, default: float, what: str, ok: Any) -> float:
    got = value.get(key, default)
    if isinstance(got, bool) or not isinstance(got, (int, float)) or not ok(got):
        raise ConfigError(f"--speculative-config {key} must be {what}, got {got!r}.", PARAM)
    return float(got)


def _positive_int(value: dict[str, Any], key: str, default: int | None) -> int | None:
    got = value.get(key, default)  # None: not given
    if got is None:
        return None
    if isinstance(got, bool) or not isinstance(got, int) or got < 1:
        raise ConfigError(f"--speculative-config {key} must be a positive integer, got {got!r}.", PARAM)
    return got
