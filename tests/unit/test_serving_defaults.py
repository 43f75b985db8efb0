"""Request fields left unset fall back to the model's generation_config.json (vLLM's behaviour);
`--generation-config vllm` turns that off; explicit request values always win."""

from __future__ import annotations

import asyncio
import json
import types

import pytest

from pagoda.errors import ConfigError, ContextLengthExceeded
from pagoda.server import protocol as p
from pagoda.server.api_process import generation_defaults as _generation_defaults
from pagoda.server.serving import OpenAIServing, ServingContext, sampling_defaults

GENERATION_CONFIG = {
    "temperature": 0.7,
    "top_p": 0.8,
    "top_k": 20,
    "repetition_penalty": 1.05,
    "max_new_tokens": 512,
    "eos_token_id": [2, 3],
    "do_sample": True,
}


def _serving(defaults: dict) -> OpenAIServing:
    ctx = ServingContext(
        engine=None,
        tokenizer=None,
        served_model_names=["m"],
        max_model_len=1024,  # type: ignore[arg-type]
        vocab_size=100,
        architecture="LlamaForCausalLM",
        chat_template=None,
        metrics=None,
        generation_defaults=defaults,
    )  # type: ignore[arg-type]
    return OpenAIServing(ctx)


def test_sampling_defaults_maps_generation_config_fields():
    assert sampling_defaults(GENERATION_CONFIG) == {
        "temperature": 0.7,
        "top_p": 0.8,
        "top_k": 20,
        "repetition_penalty": 1.05,
        "max_tokens": 512,
    }


def test_unset_fields_use_defaults_and_explicit_fields_win():
    serving = _serving(sampling_defaults(GENERATION_CONFIG))
    req = p.CompletionRequest(prompt=[5, 6, 7], max_tokens=None, top_p=0.5)
    ((_, ids, params),) = asyncio.run(serving.prepare_completion(req))
    assert (params.temperature, params.top_k, params.repetition_penalty) == (0.7, 20, 1.05)
    assert params.top_p == 0.5  # the request's own value
    assert params.max_tokens == 512  # generation_config's max_new_tokens
    plain = _serving({})
    ((_, _, params),) = asyncio.run(plain.prepare_completion(p.CompletionRequest(prompt=[5, 6, 7], max_tokens=None)))
    assert (params.temperature, params.top_p, params.top_k) == (1.0, 1.0, 0)
    assert params.max_tokens == 1024 - 3  # unset and no default: the rest of the context


def test_context_length_message_gives_the_numbers():
    serving = _serving({})
    with pytest.raises(
        ContextLengthExceeded,
        match="maximum context length is 1024 tokens.*1025 tokens "
        r"\(3 in the messages, 1022 in the completion\)",
    ):
        asyncio.run(serving.prepare_completion(p.CompletionRequest(prompt=[5, 6, 7], max_tokens=1022)))


def test_generation_config_flag(tmp_path):
    source = types.SimpleNamespace(generation_config=lambda: GENERATION_CONFIG)
    assert _generation_defaults("vllm", source, sampling_defaults) == {}
    assert _generation_defaults("auto", source, sampling_defaults)["temperature"] == 0.7
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.1}))
    assert _generation_defaults(str(tmp_path), source, sampling_defaults) == {"temperature": 0.1}
    with pytest.raises(ConfigError, match="no generation_config.json"):
        _generation_defaults(str(tmp_path / "missing"), source, sampling_defaults)
