"""HF `architectures[0]` → model class, imported lazily so unused models cost nothing."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from pagoda.errors import ModelLoadError

if TYPE_CHECKING:  # the table is read without torch (doctor's checks in the launcher)
    from torch import nn

_MODELS: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("pagoda.models.llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("pagoda.models.llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("pagoda.models.llama", "Qwen2ForCausalLM"),
    "YuanForCausalLM": ("pagoda.models.yuan", "YuanForCausalLM"),
    "Qwen2VLForConditionalGeneration": ("pagoda.models.qwen2_vl", "Qwen2VLForConditionalGeneration"),
}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def get_model_class(architecture: str) -> type[nn.Module]:
    if architecture not in _MODELS:
        raise ModelLoadError(
            f"Model architecture {architecture!r} is not supported. Supported architectures: "
            f"{', '.join(supported_architectures())}."
        )
    module, name = _MODELS[architecture]
    return getattr(importlib.import_module(module), name)
