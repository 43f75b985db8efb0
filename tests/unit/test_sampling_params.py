"""Tests for SamplingParams: defaults, normalisation, and that every bad value is an InvalidRequest naming its field."""

from __future__ import annotations

import math

import pytest

from pagoda.errors import InvalidRequest
from pagoda.sampling_params import FLOAT32_MAX, FLOAT32_TINY, SamplingParams


def test_defaults_match_vllm() -> None:
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p) == (1, 1.0, 1.0, 0, 0.0)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert p.max_tokens == 16 and p.min_tokens == 0 and p.logprobs is None and p.seed is None
    assert p.stop == [] and p.stop_token_ids == []
    assert p.skip_special_tokens and p.spaces_between_special_tokens
    assert not p.ignore_eos and not p.include_stop_str_in_output
    assert not p.is_greedy


def test_normalisation() -> None:
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]
    assert SamplingParams(stop_token_ids=(3, 0)).stop_token_ids == [3, 0]
    assert SamplingParams(top_k=-1).top_k == 0
    assert SamplingParams(top_k=7).top_k == 7
    p = SamplingParams(temperature=2, top_p=1, min_p=0)
    assert isinstance(p.temperature, float) and isinstance(p.top_p, float) and isinstance(p.min_p, float)


@pytest.mark.parametrize("t,greedy", [(0.0, True), (0, True), (9e-6, True), (1e-5, False), (0.7, False)])
def test_is_greedy(t: float, greedy: bool) -> None:
    assert SamplingParams(temperature=t).is_greedy is greedy


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(n=1),
        dict(n=8),
        dict(presence_penalty=-2.0, frequency_penalty=2.0),
        dict(repetition_penalty=0.01),
        dict(repetition_penalty=5),
        dict(temperature=0.0),
        dict(top_p=1e-9),
        dict(top_k=1),
        dict(min_p=0.0),
        dict(min_p=1.0),
        dict(seed=0),
        dict(seed=-5),
        dict(max_tokens=None),
        dict(max_tokens=1, min_tokens=1),
        dict(max_tokens=None, min_tokens=1000),
        dict(logprobs=0),
        dict(logprobs=20),
        dict(stop_token_ids=[0, 5]),
        # What float32 holds: the extremes are accepted as they are (the sampler keeps them finite).
        dict(temperature=FLOAT32_MAX, repetition_penalty=FLOAT32_MAX),
        dict(repetition_penalty=FLOAT32_TINY, top_p=FLOAT32_TINY, min_p=FLOAT32_TINY),
        dict(presence_penalty=-FLOAT32_TINY, frequency_penalty=FLOAT32_TINY),
    ],
)
def test_valid_boundaries(kwargs: dict) -> None:
    SamplingParams(**kwargs)


@pytest.mark.parametrize(
    "field,value,fragment",
    [
        ("n", 0, "n must be >= 1, got 0"),
        ("n", 1.5, "integer"),
        ("n", True, "integer"),
        ("presence_penalty", 2.01, "presence_penalty must be in [-2, 2], got 2.01"),
        ("presence_penalty", -2.5, "[-2, 2]"),
        ("frequency_penalty", 3, "frequency_penalty must be in [-2, 2], got 3"),
        ("frequency_penalty", "0.1", "number"),
        ("repetition_penalty", 0.0, "repetition_penalty must be > 0"),
        ("repetition_penalty", -1.0, "> 0"),
        ("temperature", -1, "temperature must be >= 0, got -1"),
        ("temperature", math.nan, "finite"),
        ("temperature", math.inf, "finite"),
        ("temperature", None, "number"),
        # The sampler computes in float32: a value it cannot hold (inf or 0 there) is refused.
        ("temperature", 1e308, "temperature must be 0 or of magnitude in [1.175e-38, 3.403e+38]"),
        ("temperature", 3.5e38, "float32"),
        ("temperature", 1e-300, "float32"),
        ("repetition_penalty", 1e39, "repetition_penalty must be 0 or of magnitude"),
        ("repetition_penalty", 1e-39, "float32"),
        ("top_p", 1e-300, "top_p must be 0 or of magnitude"),
        ("min_p", 1e-45, "min_p must be 0 or of magnitude"),
        ("presence_penalty", 1e-40, "float32"),
        ("frequency_penalty", -1e-40, "float32"),
        ("top_p", 0, "top_p must be in (0, 1], got 0"),
        ("top_p", 1.0001, "(0, 1]"),
        ("top_p", -0.5, "(0, 1]"),
        ("top_k", -2, "top_k must be"),
        ("top_k", 2.0, "integer"),
        ("min_p", -0.1, "min_p must be in [0, 1]"),
        ("min_p", 1.5, "[0, 1]"),
        ("seed", 1.5, "seed must be an integer"),
        ("seed", "42", "integer"),
        ("max_tokens", 0, "max_tokens must be >= 1, got 0"),
        ("max_tokens", -3, ">= 1"),
        ("max_tokens", 2.5, "integer"),
        ("min_tokens", -1, "min_tokens must be >= 0"),
        ("min_tokens", 17, "min_tokens must be <= max_tokens=16, got 17"),
        ("logprobs", -1, "logprobs must be >= 0"),
        ("logprobs", 21, "logprobs must be <= 20"),
        ("logprobs", 2.0, "integer"),
        ("stop", "", "stop"),
        ("stop", ["ok", ""], "non-empty"),
        ("stop", ["ok", 3], "stop"),
        ("stop", 3, "stop"),
        ("stop_token_ids", [1, -1], "stop_token_ids"),
        ("stop_token_ids", [1, "2"], "stop_token_ids"),
        ("stop_token_ids", 5, "stop_token_ids"),
        ("logprob_token_ids", [], "logprob_token_ids must be a non-empty list"),
        ("logprob_token_ids", [1, -1], "token ids"),
        ("logprob_token_ids", [1.0], "token ids"),
        ("logprob_token_ids", list(range(257)), "at most 256"),
    ],
)
def test_invalid_values_raise_naming_the_field(field: str, value: object, fragment: str) -> None:
    with pytest.raises(InvalidRequest) as info:
        SamplingParams(**{field: value})
    err = info.value
    assert err.param == field
    assert field in err.message
    assert fragment in err.message
    assert err.http_status == 400
    assert isinstance(err, ValueError)  # callers catching ValueError still see it
