"""Pagoda: an LLM serving engine with a paged KV cache and continuous batching."""

from pagoda.engine.llm import LLM
from pagoda.engine.outputs import CompletionOutput, RequestOutput
from pagoda.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"
