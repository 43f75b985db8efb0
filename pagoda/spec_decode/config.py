"""`--speculative-config` / `LLM(speculative_config=...)`: vLLM's JSON object, the methods built here.

vLLM's keys are accepted by name; a method or key this engine does not implement is refused in one line that
names what is supported, never accepted and ignored.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from pagoda.errors import ConfigError

METHODS = ("ngram",)
# vLLM's other methods, refused by name (with what is supported) rather than as unknown words.
KNOWN_ELSEWHERE = ("suffix", "draft_model", "eagle", "eagle3", "medusa", "mlp_speculator", "mtp")
_KEYS = {"method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "disable_by_batch_size"}
PARAM = "speculative_config"


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int  # k: proposals verified per request per step
    prompt_lookup_min: int  # n-gram lengths tried, longest first
    prompt_lookup_max: int
    disable_by_batch_size: int | None  # no proposals in steps with at least this many running requests


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
    unknown = sorted(set(value) - _KEYS)
    if unknown:
        raise ConfigError(
            f"--speculative-config keys not supported for {method!r}: {', '.join(unknown)} "
            f"(supported: {', '.join(sorted(_KEYS))}).",
            PARAM,
        )
    k = _positive_int(value, "num_speculative_tokens", None)
    if k is None:
        raise ConfigError('--speculative-config needs "num_speculative_tokens" (proposals per step, e.g. 4).', PARAM)
    # Our defaults: n-grams of 2 to 5 tokens (one repeated token is weak evidence: on open chat it proposed
    # 3x the tokens for a third more accepted, benchmarks/spec_decode_cpu.py); a lone bound keeps the other at
    # its default unless that would cross it (a max of 1 tries 1; a min of 7 tries just 7).
    given_low = _positive_int(value, "prompt_lookup_min", None)
    given_high = _positive_int(value, "prompt_lookup_max", None)
    low = given_low or min(2, given_high or 2)
    high = given_high or max(5, low)
    if low > high:
        raise ConfigError(f"prompt_lookup_min ({low}) must be <= prompt_lookup_max ({high}).", PARAM)
    disable = _positive_int(value, "disable_by_batch_size", None)
    return SpeculativeConfig(method, k, low, high, disable)


def _positive_int(value: dict[str, Any], key: str, default: int | None) -> int | None:
    got = value.get(key, default)  # None: not given
    if got is None:
        return None
    if isinstance(got, bool) or not isinstance(got, int) or got < 1:
        raise ConfigError(f"--speculative-config {key} must be a positive integer, got {got!r}.", PARAM)
    return got
