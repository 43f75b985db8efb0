"""`--speculative-config` / `LLM(speculative_config=...)`: vLLM's JSON object, the methods built here.

vLLM's keys are accepted by name; a method or key this engine does not implement is refused in one line that
names what is supported, never accepted and ignored. As in vLLM's SpeculativeConfig, "method" may be left out
when "model" says it ("ngram" or "[ngram]": prompt lookup; a model: a draft model), "[ngram]" is "ngram", a
lone n-gram bound is also the other one and both default to 5, and disable_by_batch_size is at least 2.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

from pagoda.errors import ConfigError
from pagoda.spec_decode.suffix import SuffixParams

METHODS = ("ngram", "suffix", "draft_model")
# vLLM's other methods, refused by name (with what is supported) rather than as unknown words.
KNOWN_ELSEWHERE = ("eagle", "eagle3", "medusa", "mlp_speculator", "mtp", "custom_class")
NGRAM_NAMES = ("ngram", "[ngram]")  # vLLM's spellings of prompt lookup, as "method" or as "model"
DEFAULT_PROMPT_LOOKUP = 5  # vLLM's n-gram length when neither bound is given
_COMMON = {"method", "num_speculative_tokens", "disable_by_batch_size"}
_KEYS = {
    "ngram": _COMMON | {"model", "prompt_lookup_min", "prompt_lookup_max"},  # "model": only an NGRAM_NAMES one
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
    method = _method(value)
    unknown = sorted(set(value) - _KEYS[method])
    if unknown:
        raise ConfigError(
            f"--speculative-config keys not supported for {method!r}: {', '.join(unknown)} "
            f"(supported: {', '.join(sorted(_KEYS[method]))}).",
            PARAM,
        )
    disable = value.get("disable_by_batch_size")
    if disable is not None and (isinstance(disable, bool) or not isinstance(disable, int) or disable < 2):
        raise ConfigError(
            f"--speculative-config disable_by_batch_size {disable!r}: must be an integer of at least 2 (proposals "
            "are made only while fewer requests than this run, so 1 would never propose); to decode without "
            "speculation, leave --speculative-config out.",
            PARAM,
        )
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
    if (model := value.get("model")) is not None and model not in NGRAM_NAMES:
        raise ConfigError(
            f'--speculative-config "model" {model!r} with method "ngram": prompt lookup uses no model; '
            'leave "model" out, or give "method": "draft_model" to draft with it.',
            PARAM,
        )
    # vLLM's rule: a lone bound is both bounds (max 3 alone tries 3-grams only), neither gives 5 and 5.
    low = _positive_int(value, "prompt_lookup_min", None)
    high = _positive_int(value, "prompt_lookup_max", None)
    if low is None and high is None:
        low = high = DEFAULT_PROMPT_LOOKUP
    low = low or high
    high = high or low
    assert low is not None and high is not None
    if low > high:
        raise ConfigError(f"prompt_lookup_min ({low}) must be <= prompt_lookup_max ({high}).", PARAM)
    return SpeculativeConfig(method, k, low, high, disable)


def _method(value: dict[str, Any]) -> str:
    """The method, given or inferred from "model" as vLLM infers it; refused unless built here."""
    method, model = value.get("method"), value.get("model")
    if method is None:
        if model is None:
            raise ConfigError(
                f'--speculative-config needs "method" (supported: {", ".join(METHODS)}) or a draft "model".', PARAM
            )
        if not isinstance(model, str) or not model:
            raise ConfigError('--speculative-config "model" must be the draft model\'s folder, hub id or .gguf.', PARAM)
        if model in NGRAM_NAMES:
            method = "ngram"
        elif _is_import_path(model):
            raise ConfigError(
                f'--speculative-config "model" {model!r} reads as a Python class (vLLM\'s method "custom_class"), '
                'which is not supported; for a draft model give "method": "draft_model" or its folder\'s path.',
                PARAM,
            )
        else:
            method = "draft_model"
    if method == "[ngram]":
        method = "ngram"
    if method not in METHODS:
        known = "vLLM's method " if method in KNOWN_ELSEWHERE else "method "
        raise ConfigError(
            f"--speculative-config {known}{method!r} is not supported; supported: {', '.join(METHODS)}.", PARAM
        )
    return str(method)


def _is_import_path(model: str) -> bool:
    """`pkg.module.Class`, as vLLM tells a custom proposer class from a model: dotted identifiers, no "/", and
    here also no file or folder of that name (a draft `smol.gguf` in the working folder is a model)."""
    parts = model.split(".")
    return (
        "/" not in model
        and len(parts) >= 2
        and all(part.isidentifier() for part in parts)
        and not os.path.exists(model)
    )


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
