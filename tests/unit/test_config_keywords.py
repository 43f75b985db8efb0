"""`LLM(**kwargs)` and the multimodal config: unknown keywords and bad flag values fail with a clear message,
before any model is read; the CLI's strings become the same typed config the offline keywords give."""

from __future__ import annotations

import dataclasses

import pytest

from pagoda.config import EngineArgs
from pagoda.config.multimodal import MultiModalConfig
from pagoda.errors import ConfigError


def test_unknown_llm_keyword_names_itself_and_the_closest_valid_one():
    from pagoda import LLM

    with pytest.raises(TypeError) as info:
        LLM(model="/no/such/folder", max_model_lenn=64)
    message = str(info.value)
    assert "max_model_lenn" in message and "did you mean 'max_model_len'" in message
    # Every engine and multimodal knob is listed as valid.
    for name in [f.name for f in dataclasses.fields(EngineArgs) if f.name != "model"]:
        assert name in message
    assert "limit_mm_per_prompt" in message


def test_bad_multimodal_keyword_fails_before_the_model_is_read():
    from pagoda import LLM

    with pytest.raises(ConfigError) as info:  # the folder does not exist: the mm check must come first
        LLM(model="/no/such/folder", limit_mm_per_prompt={"audio": 1})
    assert "unknown modality 'audio'" in str(info.value)


@pytest.mark.parametrize("text", ['{"image": 4, "video": 1}', "image=4,video=1", " image = 4 , video=1 "])
def test_cli_limits_spellings_give_the_offline_dict(text):
    assert MultiModalConfig.from_cli(limit_mm_per_prompt=text) == MultiModalConfig(
        limit_mm_per_prompt={"image": 4, "video": 1}
    )
    assert MultiModalConfig.from_cli(limit_mm_per_prompt=text).limits == {"image": 4, "video": 1}


def test_default_limits_apply_per_modality():
    assert MultiModalConfig().limits == {"image": 16, "video": 2}
    assert MultiModalConfig(limit_mm_per_prompt={"video": 0}).limits == {"image": 16, "video": 0}


@pytest.mark.parametrize(
    "flag, value, fragment",
    [
        ("limit_mm_per_prompt", "image=-1", "image limit must be >= 0"),
        ("limit_mm_per_prompt", "audio=1", "unknown modality 'audio'"),
        ("limit_mm_per_prompt", "image=four", "--limit-mm-per-prompt 'image=four'"),
        ("limit_mm_per_prompt", "{not json", "--limit-mm-per-prompt '{not json'"),
        ("mm_processor_kwargs", "[1, 2]", "expected a JSON object"),
        ("mm_processor_kwargs", "{bad", "--mm-processor-kwargs '{bad'"),
    ],
)
def test_bad_cli_values_name_the_flag(flag, value, fragment):
    with pytest.raises(ConfigError) as info:
        MultiModalConfig.from_cli(**{flag: value})
    assert fragment in str(info.value)
    assert info.value.param == flag


def test_the_serve_flags_build_each_config_the_one_way():
    """`cli.args.config_from` builds every config from the parsed flags: the multimodal strings parsed, the flags
    left out at the dataclass's defaults (the same objects `LLM(...)`'s keywords give)."""
    import argparse

    from pagoda.cli.args import config_from
    from pagoda.cli.serve import add_serve_args
    from pagoda.config.server import ServerConfig

    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    ns = parser.parse_args(["--limit-mm-per-prompt", "image=4", "--mm-processor-kwargs", '{"max_pixels": 1000}'])
    assert config_from(ns, MultiModalConfig) == MultiModalConfig(
        limit_mm_per_prompt={"image": 4}, mm_processor_kwargs={"max_pixels": 1000}
    )
    defaults = parser.parse_args([])
    assert config_from(defaults, MultiModalConfig) == MultiModalConfig()
    assert config_from(defaults, EngineArgs) == EngineArgs()
    assert config_from(defaults, ServerConfig) == ServerConfig()
    with pytest.raises(ConfigError, match="--limit-mm-per-prompt 'image=x'"):
        config_from(parser.parse_args(["--limit-mm-per-prompt", "image=x"]), MultiModalConfig)
