"""A broken model folder fails with a message that names the problem, never a traceback deep inside."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from pagoda import LLM
from pagoda.errors import ModelLoadError
from tests.conftest import build_tiny_model


@pytest.fixture()
def sharded(tmp_path) -> str:
    return build_tiny_model("qwen2", str(tmp_path / "sharded"), max_shard_size="100KB")


def _load(folder: str) -> LLM:
    return LLM(model=folder, skip_tokenizer_init=True, max_model_len=128, num_gpu_blocks_override=16)


def _shards(folder: str) -> list[str]:
    return sorted(n for n in os.listdir(folder) if n.endswith(".safetensors"))


def test_missing_shard_is_named(sharded):
    victim = _shards(sharded)[1]
    os.remove(os.path.join(sharded, victim))
    with pytest.raises(ModelLoadError, match=f"{victim} is listed .* but missing"):
        _load(sharded)


def test_extra_shard_is_named(sharded):
    shards = _shards(sharded)
    total = len(shards)
    extra = f"model-{total + 1:05d}-of-{total:05d}.safetensors"
    shutil.copy(os.path.join(sharded, shards[0]), os.path.join(sharded, extra))
    with pytest.raises(ModelLoadError, match=f"{extra} .* is not listed"):
        _load(sharded)


def test_unknown_architecture_lists_supported(sharded):
    path = os.path.join(sharded, "config.json")
    with open(path) as f:
        config = json.load(f)
    config["architectures"] = ["FancyNewForCausalLM"]
    with open(path, "w") as f:
        json.dump(config, f)
    with pytest.raises(ModelLoadError, match="FancyNewForCausalLM.*Supported architectures: .*LlamaForCausalLM"):
        _load(sharded)


def test_missing_folder_and_config(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        _load(str(tmp_path / "nope" / "deeper" / "model"))
    with pytest.raises(ModelLoadError, match="no config.json"):
        _load(str(tmp_path))


def test_missing_weight_is_named(tmp_path):
    from safetensors.torch import load_file, save_file

    folder = build_tiny_model("llama", str(tmp_path / "m"))
    path = os.path.join(folder, "model.safetensors")
    tensors = load_file(path)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match="model.layers.1.mlp.gate_up_proj.weight:up"):
        _load(folder)
