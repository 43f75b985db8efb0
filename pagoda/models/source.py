"""Where a model comes from: an HF folder, a hub id (when online), or a GGUF file.

`resolve_model_source` reads only the config; weights are streamed later, one tensor at a time,
through `ModelSource.iter_weights()`, so a checkpoint is never held in memory twice.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from pagoda.errors import ModelLoadError

_SHARD_PATTERN = re.compile(r".*-\d{5}-of-\d{5}\.safetensors$")


@dataclass(frozen=True)
class ModelSource:
    location: str                       # folder or .gguf path
    kind: str                           # "hf" or "gguf"
    hf_config: dict[str, Any] = field(repr=False)

    @property
    def folder(self) -> str:
        return self.location if self.kind == "hf" else os.path.dirname(self.location)

    def iter_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        if self.kind == "gguf":
            from pagoda.models.gguf_checkpoint import iter_gguf_tensors

            yield from iter_gguf_tensors(self.location, self.hf_config)
        else:
            yield from iter_safetensors(self.location)

    def generation_config(self) -> dict[str, Any]:
        """The folder's generation_config.json (sampling defaults, EOS ids), or {}."""
        path = os.path.join(self.folder, "generation_config.json")
        if self.kind != "hf" or not os.path.isfile(path):
            return {}
        with open(path) as f:
            return json.load(f)


def resolve_model_source(model: str | None) -> ModelSource:
    if model is None:
        from pagoda.models.gguf_checkpoint import default_gguf_path

        model = default_gguf_path()
    if model.endswith(".gguf"):
        if not os.path.isfile(model):
            raise ModelLoadError(f"GGUF file {model!r} does not exist.")
        from pagoda.models.gguf_checkpoint import read_gguf_config

        return ModelSource(location=model, kind="gguf", hf_config=read_gguf_config(model))
    folder = model if os.path.isdir(model) else _download(model)
    config_path = os.path.join(folder, "config.json")
    if not os.path.isfile(config_path):
        raise ModelLoadError(f"{folder!r} has no config.json; pass an HF model folder or a .gguf file.")
    with open(config_path) as f:
        hf_config = json.load(f)
    return ModelSource(location=folder, kind="hf", hf_config=hf_config)


def _download(model_id: str) -> str:
    """Resolve a hub id to a local snapshot (cache first, then the network)."""
    if model_id.startswith(("/", ".", "~")) or model_id.count("/") > 1:
        raise ModelLoadError(f"Model folder {model_id!r} does not exist.")
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(
            model_id, allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.py"])
    except Exception as exc:  # offline, unknown repo, auth... all mean the same to the user
        raise ModelLoadError(
            f"{model_id!r} is not a local folder and could not be fetched from the hub "
            f"({type(exc).__name__}); pass the path of a downloaded model folder.") from None


def iter_safetensors(folder: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) shard by shard; a shard missing from or extra to the index is an error."""
    from safetensors import safe_open

    for path in _shard_paths(folder):
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def _shard_paths(folder: str) -> list[str]:
    index_path = os.path.join(folder, "model.safetensors.index.json")
    present = sorted(n for n in os.listdir(folder) if n.endswith(".safetensors"))
    if os.path.isfile(index_path):
        with open(index_path) as f:
            listed = sorted(set(json.load(f)["weight_map"].values()))
        for name in listed:
            if name not in present:
                raise ModelLoadError(
                    f"Shard {name} is listed in model.safetensors.index.json but missing from {folder}; "
                    "re-download the model.")
        for name in present:
            if name not in listed and _SHARD_PATTERN.match(name):
                raise ModelLoadError(
                    f"Shard {name} in {folder} is not listed in model.safetensors.index.json; remove it "
                    "or fix the index.")
        return [os.path.join(folder, n) for n in listed]
    if "model.safetensors" in present:
        return [os.path.join(folder, "model.safetensors")]
    if present:
        return [os.path.join(folder, n) for n in present]
    raise ModelLoadError(f"No *.safetensors weights found in {folder}; Pagoda loads safetensors checkpoints.")
