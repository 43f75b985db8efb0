"""The name a server answers to without --served-model-name: the model argument as the user typed it (vLLM's
rule: a hub id stays a hub id, not the snapshot folder it resolved to), the embedded default's own name when no
model was given (never the GGUF's path inside site-packages), and --served-model-name over both. The README's
commands end to end: tests/e2e/test_readme_quickstart.py."""

from __future__ import annotations

import os

from pagoda.config import EngineConfig
from pagoda.config.multimodal import MultiModalConfig
from pagoda.config.server import ServerConfig
from pagoda.models import source as model_source

DEFAULT_NAME = "SmolLM2-135M-Instruct"  # the README's curl asks for this name


def _names(config: EngineConfig, **server: object) -> list[str]:
    from pagoda.server.api_process import ApiSetup

    return ApiSetup(ServerConfig(**server), config, MultiModalConfig(), check=False).names  # type: ignore[arg-type]


def test_no_model_is_served_under_the_embedded_models_name_not_its_path():
    config = EngineConfig.create(device="cpu", skip_tokenizer_init=True, max_model_len=64)
    assert config.model.model.endswith(".gguf") and os.path.isfile(config.model.model)  # loads from the package
    assert _names(config) == [DEFAULT_NAME]


def test_a_hub_id_is_served_as_typed_not_as_its_snapshot_folder(tiny_llama, monkeypatch):
    monkeypatch.setattr(model_source, "_download", lambda model_id: tiny_llama)  # a cached snapshot, offline
    config = EngineConfig.create(model="acme/tiny-llama", device="cpu", skip_tokenizer_init=True)
    assert config.model.model == tiny_llama
    assert _names(config) == ["acme/tiny-llama"]


def test_a_folder_is_served_as_typed_and_served_model_name_wins(tiny_llama, monkeypatch):
    monkeypatch.chdir(os.path.dirname(tiny_llama))
    typed = os.path.join(".", os.path.basename(tiny_llama))
    config = EngineConfig.create(model=typed, device="cpu", skip_tokenizer_init=True)
    assert _names(config) == [typed]
    assert _names(config, served_model_name=("qwen2", "alias")) == ["qwen2", "alias"]
