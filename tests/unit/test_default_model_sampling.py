"""The embedded default model ships sampling defaults, served as an HF folder's generation_config.json
is: a bare request (the README's first curl) gets a low temperature and a bounded answer, not
temperature 1 up to the end of the context."""

from __future__ import annotations

import asyncio
import logging
import os

from pagoda.models.gguf_checkpoint import DEFAULT_GENERATION_CONFIG, default_gguf_path
from pagoda.models.source import ModelSource
from pagoda.server import protocol as p
from pagoda.server.api_process import generation_defaults as _generation_defaults
from pagoda.server.serving import OpenAIServing, ServingContext, sampling_defaults


def _source(path: str) -> ModelSource:
    return ModelSource(location=path, kind="gguf", hf_config={})


def test_the_embedded_model_has_bounded_low_temperature_defaults(tmp_path, caplog) -> None:
    source = _source(default_gguf_path())
    assert source.generation_config() == DEFAULT_GENERATION_CONFIG
    with caplog.at_level(logging.INFO):
        defaults = _generation_defaults("auto", source, sampling_defaults)
    assert defaults == {"temperature": 0.2, "top_p": 0.9, "max_tokens": 256}
    assert "Sampling defaults" in caplog.text and "'max_tokens': 256" in caplog.text
    assert _generation_defaults("vllm", source, sampling_defaults) == {}
    # The same file under another name is the same model.
    link = tmp_path / "smol.gguf"
    os.symlink(default_gguf_path(), link)
    assert _source(str(link)).generation_config() == DEFAULT_GENERATION_CONFIG


def test_other_gguf_files_get_no_defaults(tmp_path) -> None:
    other = tmp_path / "other.gguf"
    other.write_bytes(b"GGUF")
    assert _source(str(other)).generation_config() == {}


def test_a_bare_request_to_the_embedded_model_is_bounded() -> None:
    ctx = ServingContext(
        engine=None,
        tokenizer=None,
        served_model_names=["m"],
        max_model_len=2048,
        vocab_size=49152,
        architecture="LlamaForCausalLM",
        chat_template=None,
        metrics=None,  # type: ignore[arg-type]
        generation_defaults=sampling_defaults(DEFAULT_GENERATION_CONFIG),
    )
    request = p.CompletionRequest(prompt=[5, 6, 7], max_tokens=None)
    ((_, _, params),) = asyncio.run(OpenAIServing(ctx).prepare_completion(request))
    assert (params.max_tokens, params.temperature, params.top_p) == (256, 0.2, 0.9)
