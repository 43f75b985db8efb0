"""PyTorch `pytorch_model*.bin` checkpoints (as Yuan2.0 ships them) stream like safetensors ones."""

from __future__ import annotations

import json
import os

import pytest
import torch

from pagoda.errors import ModelLoadError
from pagoda.layers.linear import read_weight
from pagoda.models.source import resolve_model_source

EXECUTED: list[str] = []


def _mark_executed() -> None:
    EXECUTED.append("ran")


class Payload:
    """Unpickling this calls `_mark_executed`: the stand-in for a checkpoint that runs code."""

    def __reduce__(self):
        return _mark_executed, ()


def _state_dict() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "model.embed_tokens.weight": torch.randn(8, 4, generator=g),
        "model.layers.0.mlp.up_proj.weight": torch.randn(6, 4, generator=g),
        "model.norm.weight": torch.randn(4, generator=g),
        "lm_head.weight": torch.randn(8, 4, generator=g, dtype=torch.float64),
    }


def _folder(path) -> str:
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({"architectures": ["LlamaForCausalLM"]}, f)
    return str(path)


def _save_sharded(folder: str, state: dict[str, torch.Tensor]) -> list[str]:
    """Two shards and the index that lists them, as transformers 4 wrote them."""
    names = list(state)
    half = len(names) // 2
    shards = {"pytorch_model-00001-of-00002.bin": names[:half], "pytorch_model-00002-of-00002.bin": names[half:]}
    for shard, keys in shards.items():
        torch.save({k: state[k] for k in keys}, os.path.join(folder, shard))
    weight_map = {k: shard for shard, keys in shards.items() for k in keys}
    with open(os.path.join(folder, "pytorch_model.bin.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    return sorted(shards)


def _weights(folder: str) -> dict[str, torch.Tensor]:
    source = resolve_model_source(folder)
    # Safetensors entries are read lazily, while their file is open: read each before the next.
    pairs = [(name, read_weight(tensor)) for name, tensor in source.iter_weights()]
    names = [n for n, _ in pairs]
    assert len(names) == len(set(names))
    return dict(pairs)


def _assert_same(loaded: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert sorted(loaded) == sorted(expected)
    for name, tensor in expected.items():
        assert loaded[name].dtype == tensor.dtype
        assert torch.equal(loaded[name], tensor), name


def test_single_bin(tmp_path):
    folder = _folder(tmp_path / "m")
    state = _state_dict()
    torch.save(state, os.path.join(folder, "pytorch_model.bin"))
    torch.save({"lr": 0.1}, os.path.join(folder, "training_args.bin"))  # not weights: ignored
    _assert_same(_weights(folder), state)


def test_legacy_non_zip_bin_loads_without_mmap(tmp_path):
    folder = _folder(tmp_path / "m")
    state = _state_dict()
    torch.save(state, os.path.join(folder, "pytorch_model.bin"), _use_new_zipfile_serialization=False)
    _assert_same(_weights(folder), state)


def test_sharded_bin_with_index(tmp_path):
    folder = _folder(tmp_path / "m")
    state = _state_dict()
    _save_sharded(folder, state)
    _assert_same(_weights(folder), state)


def test_unindexed_shards_are_all_read(tmp_path):
    folder = _folder(tmp_path / "m")
    state = _state_dict()
    _save_sharded(folder, state)
    os.remove(os.path.join(folder, "pytorch_model.bin.index.json"))
    _assert_same(_weights(folder), state)


def test_missing_listed_shard_is_named(tmp_path):
    folder = _folder(tmp_path / "m")
    victim = _save_sharded(folder, _state_dict())[1]
    os.remove(os.path.join(folder, victim))
    with pytest.raises(
        ModelLoadError, match=f"{victim} is listed in pytorch_model.bin.index.json but missing.*re-download"
    ):
        _weights(folder)


def test_unlisted_shard_is_named(tmp_path):
    folder = _folder(tmp_path / "m")
    _save_sharded(folder, _state_dict())
    extra = "pytorch_model-00003-of-00002.bin"
    torch.save({"stale": torch.zeros(1)}, os.path.join(folder, extra))
    with pytest.raises(ModelLoadError, match=f"{extra} .* is not listed in pytorch_model.bin.index.json; remove it"):
        _weights(folder)


def test_pickle_with_code_is_refused_without_running_it(tmp_path):
    folder = _folder(tmp_path / "m")
    torch.save({"model.norm.weight": torch.ones(4), "evil": Payload()}, os.path.join(folder, "pytorch_model.bin"))
    assert EXECUTED == []  # saving only records the call
    with pytest.raises(ModelLoadError, match="not a plain tensor checkpoint.*never runs code.*safetensors"):
        _weights(folder)
    assert EXECUTED == []


def test_pickle_of_non_tensor_data_is_refused(tmp_path):
    folder = _folder(tmp_path / "m")
    torch.save({"model": {"w": torch.ones(2)}, "step": 3}, os.path.join(folder, "pytorch_model.bin"))
    with pytest.raises(ModelLoadError, match="not a plain tensor checkpoint.*safetensors"):
        _weights(folder)


def test_safetensors_win_over_bin(tmp_path):
    from safetensors.torch import save_file

    folder = _folder(tmp_path / "m")
    state = _state_dict()
    save_file(state, os.path.join(folder, "model.safetensors"))
    torch.save({"only.in.bin": torch.zeros(3)}, os.path.join(folder, "pytorch_model.bin"))
    _assert_same(_weights(folder), state)


def test_no_weights(tmp_path):
    folder = _folder(tmp_path / "m")
    torch.save({"lr": 0.1}, os.path.join(folder, "training_args.bin"))
    torch.save({"step": torch.zeros(1)}, os.path.join(folder, "optimizer.pt"))
    with pytest.raises(ModelLoadError, match=r"No \*\.safetensors or pytorch_model\*\.bin weights found in"):
        _weights(folder)


def _fake_hub(monkeypatch, tmp_path, repo_files: list[str]) -> list[list[str]]:
    """A `snapshot_download` that 'downloads' the repo files its allow_patterns match, recording each call."""
    import fnmatch

    import huggingface_hub

    snapshot = tmp_path / "snapshot"
    snapshot.mkdir()
    calls: list[list[str]] = []

    def snapshot_download(repo_id: str, allow_patterns: list[str]) -> str:
        calls.append(allow_patterns)
        for name in repo_files:
            if any(fnmatch.fnmatch(name, p) for p in allow_patterns):
                (snapshot / name).write_bytes(b"")
        return str(snapshot)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    return calls


def test_download_fetches_bin_only_when_repo_has_no_safetensors(monkeypatch, tmp_path):
    from pagoda.models.source import _download

    calls = _fake_hub(
        monkeypatch,
        tmp_path,
        [
            "config.json",
            "pytorch_model.bin.index.json",
            "training_args.bin",
            "pytorch_model-00001-of-00002.bin",
            "pytorch_model-00002-of-00002.bin",
        ],
    )
    folder = _download("IEITYuan/Yuan2-2B-hf")
    assert len(calls) == 2 and calls[1] == ["pytorch_model*.bin", "*.bin.index.json"]
    assert sorted(os.listdir(folder)) == [
        "config.json",
        "pytorch_model-00001-of-00002.bin",
        "pytorch_model-00002-of-00002.bin",
        "pytorch_model.bin.index.json",
    ]


def test_download_skips_bin_when_repo_has_safetensors(monkeypatch, tmp_path):
    from pagoda.models.source import _download

    calls = _fake_hub(monkeypatch, tmp_path, ["config.json", "model.safetensors", "pytorch_model.bin"])
    folder = _download("org/both-formats")
    assert len(calls) == 1
    assert sorted(os.listdir(folder)) == ["config.json", "model.safetensors"]


@pytest.mark.parametrize("sharded", [False, True])
def test_load_model_from_transformers_bin_checkpoint(tmp_path, sharded):
    """transformers 5 no longer writes .bin (`save_pretrained(safe_serialization=False)` still gives
    safetensors), so the checkpoint is written as transformers 4 did: config + torch.save(state_dict)."""
    import transformers

    from pagoda.models.loader import load_model
    from tests.conftest import TINY_CONFIGS

    folder = str(tmp_path / "tiny-llama-bin")
    torch.manual_seed(1234)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY_CONFIGS["llama"])).eval()
    hf.config.save_pretrained(folder)
    ref = {k: v.clone() for k, v in hf.state_dict().items()}
    if sharded:
        _save_sharded(folder, hf.state_dict())
    else:
        torch.save(hf.state_dict(), os.path.join(folder, "pytorch_model.bin"))
    files = os.listdir(folder)
    assert any(n.endswith(".bin") for n in files) and not any(n.endswith(".safetensors") for n in files)

    ours = load_model(resolve_model_source(folder), max_model_len=128, dtype=torch.float32, device="cpu")
    params = dict(ours.named_parameters())
    torch.testing.assert_close(params["model.embed_tokens.weight"], ref["model.embed_tokens.weight"], atol=0, rtol=0)
    for layer in range(TINY_CONFIGS["llama"]["num_hidden_layers"]):
        prefix = f"model.layers.{layer}.self_attn"
        fused = torch.cat([ref[f"{prefix}.{p}.weight"] for p in ("q_proj", "k_proj", "v_proj")])
        torch.testing.assert_close(params[f"{prefix}.qkv_proj.weight"], fused, atol=0, rtol=0)
        torch.testing.assert_close(params[f"{prefix}.o_proj.weight"], ref[f"{prefix}.o_proj.weight"], atol=0, rtol=0)
    torch.testing.assert_close(params["model.norm.weight"], ref["model.norm.weight"], atol=0, rtol=0)
