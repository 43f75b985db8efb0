"""Engine flags for every subcommand, generated from `EngineArgs` so each flag maps to one field."""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing

from pagoda.config import EngineArgs

_HELP = {
    "model": "HF model folder, hub id or .gguf file (default: the embedded SmolLM2-135M-Instruct)",
    "tokenizer": "tokenizer folder or hub id (default: the model's)",
    "dtype": "auto | float32 | float16 | bfloat16",
    "max_model_len": "context length cap (default: from the model config)",
    "max_num_seqs": "maximum requests per step",
    "max_num_batched_tokens": "token budget per step (default: 8192)",
    "block_size": "tokens per KV cache block",
    "enable_prefix_caching": "reuse KV blocks across requests that share a prefix",
    "gpu_memory_utilization": "fraction of GPU memory the engine may use (default 0.9; on the CPU "
                              "--cpu-kv-cache-space-gib sets the KV budget instead)",
    "num_gpu_blocks_override": "exact number of KV blocks (testing)",
    "swap_space": "accepted for vLLM compatibility (preemption recomputes)",
    "cpu_kv_cache_space_gib": "KV cache budget in GiB when running on the CPU",
    "device": "auto | cpu | cuda",
    "seed": "random seed for requests without their own seed",
    "trust_remote_code": "accepted for vLLM compatibility: Pagoda never runs code shipped in a model folder",
    "skip_tokenizer_init": "do not load a tokenizer (token-id prompts only)",
    "load_format": "auto (the checkpoint's weights) | dummy (random weights of the right shapes, for benchmarks)",
    "attention_backend": "auto (triton on a CUDA GPU, torch on the CPU) | torch | triton (Triton kernels, CUDA only)",
    "enforce_eager": "never capture CUDA graphs: run every decode step eagerly (slower; for debugging)",
    "async_scheduling": "schedule and launch the next step while the GPU runs the current one (default: on "
                        "with CUDA, off on the CPU; a request that stops on EOS costs one discarded token)",
    "quantization": "vLLM's quantization method (awq, gptq, fp8...): not supported yet, only none is accepted",
}
# vLLM's short spellings of the same flags.
_ALIASES = {"quantization": ("-q",)}


def _base_type(annotation: str) -> type:
    hint = eval(annotation, {"typing": typing}) if isinstance(annotation, str) else annotation  # noqa: S307
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        return args[0]
    return hint


def add_engine_args(parser: argparse.ArgumentParser, skip: tuple[str, ...] = ()) -> None:
    for f in dataclasses.fields(EngineArgs):
        if f.name in skip:
            continue
        flags = ["--" + f.name.replace("_", "-"), *_ALIASES.get(f.name, ())]
        kind = _base_type(f.type)
        if kind is bool:
            parser.add_argument(*flags, action=argparse.BooleanOptionalAction, default=f.default, help=_HELP[f.name])
        else:
            parser.add_argument(*flags, type=kind, default=f.default, help=_HELP[f.name])


def engine_args_from(ns: argparse.Namespace) -> EngineArgs:
    return EngineArgs(**{f.name: getattr(ns, f.name) for f in dataclasses.fields(EngineArgs)})
