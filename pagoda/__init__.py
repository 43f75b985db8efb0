"""Pagoda: an LLM serving engine with a paged KV cache and continuous batching."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"

if TYPE_CHECKING:
    from pagoda.engine.llm import LLM
    from pagoda.outputs import CompletionOutput, RequestOutput
    from pagoda.sampling_params import SamplingParams, StructuredOutputsParams

_EXPORTS = {
    "LLM": "pagoda.engine.llm",
    "RequestOutput": "pagoda.outputs",
    "CompletionOutput": "pagoda.outputs",
    "SamplingParams": "pagoda.sampling_params",
    "StructuredOutputsParams": "pagoda.sampling_params",
}


def __getattr__(name: str) -> Any:
    # Lazy: `pagoda bench` / `pagoda plan` start without importing torch and the engine.
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'pagoda' has no attribute {name!r}")
