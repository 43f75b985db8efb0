"""Bounds on request fields that cost memory or time: `SamplingParams` refuses them offline with
InvalidRequest naming the field, the server's schema refuses them before building anything."""

from __future__ import annotations

import asyncio
import time

import pytest
from pydantic import TypeAdapter, ValidationError

from pagoda.errors import InvalidRequest
from pagoda.sampling_params import MAX_N, MAX_STOP_CHARS, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS, SamplingParams
from pagoda.server import protocol as p
from pagoda.server.serving import OpenAIServing, ServingContext


@pytest.mark.parametrize(
    "kwargs,param,limit",
    [
        ({"n": 2**63}, "n", MAX_N),
        ({"n": MAX_N + 1}, "n", MAX_N),
        ({"stop": ["x"] * (MAX_STOP_STRINGS + 1)}, "stop", MAX_STOP_STRINGS),
        ({"stop": "x" * (MAX_STOP_CHARS + 1)}, "stop", MAX_STOP_CHARS),
        ({"stop_token_ids": [1] * (MAX_STOP_TOKEN_IDS + 1)}, "stop_token_ids", MAX_STOP_TOKEN_IDS),
    ],
)
def test_sampling_params_refuse_absurd_values(kwargs: dict, param: str, limit: int) -> None:
    with pytest.raises(InvalidRequest) as info:
        SamplingParams(**kwargs)
    assert info.value.param == param and str(limit) in info.value.message


def test_sampling_params_at_the_bounds() -> None:
    params = SamplingParams(
        n=MAX_N, stop=["x" * MAX_STOP_CHARS] * MAX_STOP_STRINGS, stop_token_ids=list(range(MAX_STOP_TOKEN_IDS))
    )
    assert params.n == MAX_N and len(params.stop) == MAX_STOP_STRINGS


MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    "model,body,loc",
    [
        (p.CompletionRequest, {"prompt": "a", "n": 9223372036854775808}, "n"),
        (p.CompletionRequest, {"prompt": "a", "stop": ["x"] * 100_000}, "stop"),
        (p.CompletionRequest, {"prompt": "a", "stop": "x" * 1_000_000}, "stop"),
        (p.ChatCompletionRequest, {"messages": MESSAGES, "stop_token_ids": [1] * 100_000}, "stop_token_ids"),
        (p.CompletionRequest, {"prompt": ["a"] * 100_000}, "prompt"),
        (p.CompletionRequest, {"prompt": [[1]] * 100_000}, "prompt"),
        (p.ChatCompletionRequest, {"messages": MESSAGES * 1_000_000}, "messages"),
        (
            p.ChatCompletionRequest,
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}] * 100_000}]},
            "messages",
        ),
        (p.TokenizeRequest, {"messages": MESSAGES * 1_000_000}, "messages"),
    ],
)
def test_schema_refuses_oversized_fields_without_building_them(model: type, body: dict, loc: str) -> None:
    t0 = time.perf_counter()
    with pytest.raises(ValidationError) as info:
        model.model_validate(body)
    assert time.perf_counter() - t0 < 0.05  # checked on the raw list: a million messages take ~10 s to build
    assert info.value.errors()[0]["loc"] == (loc,)


@pytest.mark.parametrize("prompt", [[1, 2, 3], [1, "2"], [1, 2.0], [1, [2]], [1, "x"], [[1, 2], [3]], ["a", "b"]])
def test_token_id_prompt_fast_path_matches_the_union(prompt: list) -> None:
    union: TypeAdapter = TypeAdapter(str | list[str] | list[int] | list[list[int]])
    try:
        expected = union.validate_python(prompt)
    except ValidationError:
        with pytest.raises(ValidationError):
            p.CompletionRequest(prompt=prompt)
        return
    assert p.CompletionRequest(prompt=prompt).prompt == expected


def _serving() -> OpenAIServing:
    ctx = ServingContext(
        engine=None,
        tokenizer=None,
        served_model_names=["m"],  # type: ignore[arg-type]
        max_model_len=1024,
        vocab_size=100,
        architecture="LlamaForCausalLM",
        chat_template=None,
        metrics=None,
    )  # type: ignore[arg-type]
    return OpenAIServing(ctx)


def test_n_times_prompts_is_bounded() -> None:
    serving = _serving()
    with pytest.raises(InvalidRequest) as info:
        asyncio.run(serving.prepare_completion(p.CompletionRequest(prompt=[[5, 6]] * 17, n=128, max_tokens=2)))
    assert info.value.param == "n" and str(p.MAX_PROMPTS) in info.value.message
    prepared = asyncio.run(serving.prepare_completion(p.CompletionRequest(prompt=[[5, 6]] * 16, n=128, max_tokens=2)))
    assert len(prepared) == 16


def test_overlong_token_prompt_is_refused_before_its_ids_are_scanned() -> None:
    from pagoda.errors import ContextLengthExceeded

    with pytest.raises(ContextLengthExceeded):
        asyncio.run(_serving().prepare_completion(p.CompletionRequest(prompt=[10**9] * 5000, max_tokens=2)))
