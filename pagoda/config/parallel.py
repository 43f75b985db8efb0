"""Tensor and pipeline parallelism: the section of the engine config, and the rules for which sizes a model
accepts (`pipeline_parallel_error`: a stage needs at least one decoder layer).

`tensor_parallel_problems` is the rule; `pagoda serve` (its startup refusal, `tensor_parallel_error`),
`pagoda plan` and `pagoda doctor` all call it, so the three always agree. It reads config.json only
(no torch), with the sharding scheme the models use:

- attention: heads are split over the ranks, so `num_attention_heads` must divide by n;
- KV heads (`num_key_value_heads`, default = the attention heads): split when they divide by n, else
  replicated when n divides by them (each KV head on n / kv ranks, as vLLM does); any other n fails;
- MLP: column- then row-parallel, so `intermediate_size` must divide by n;
- embedding and LM head: vocab-parallel, so `vocab_size` must divide by n;
- Yuan2 (docs/models.md, Yuan2: tensor parallelism): the heads are `num_attention_heads` (the fused
  q/k projection splits by heads, `attention_projection_size / heads` dims each); the LF gate and the
  MoE router are replicated; M32's experts are each column/row split, so `moe_config.ffn_hidden_size`
  must divide by n (its unused `intermediate_size` is not checked);
- Qwen2-VL: the text model's fields, flat or nested under `text_config`. The vision tower (and its
  merger) is replicated on every rank, not sharded, so the vision heads impose no constraint.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pagoda.models.families import family_of


@dataclass(frozen=True, kw_only=True)
class ParallelConfig:
    tensor_parallel_size: int  # ranks (GPUs) one model is sharded over; 1: no sharding
    distributed_executor_backend: str  # how the ranks are started: "mp" | "ray"
    pipeline_parallel_size: int  # stages of consecutive decoder layers, each of tensor_parallel_size ranks

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size


def _text_fields(hf_config: dict[str, Any]) -> dict[str, Any]:
    """The language model's fields, flat, whichever layout config.json uses (nested `text_config` wins, as in
    models/qwen2_vl.py `text_config`). Local, not config.engine's `text_field`: engine.py imports this module."""
    flat = {k: v for k, v in hf_config.items() if k not in ("text_config", "vision_config")}
    flat.update(hf_config.get("text_config") or {})
    return flat


def _positive_int(value: Any) -> int | None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        return None
    return value


def tensor_parallel_problems(hf_config: dict[str, Any], n: int) -> list[str]:
    """Every reason tensor parallel size `n` does not fit this model, each phrased for a user; [] when it fits.

    Fields the model needs but the config lacks are not reported here (the model refuses such a config
    itself), except the attention heads, without which no split can be checked.
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        return [f"the tensor parallel size must be at least 1 (got {n!r})"]
    if n == 1:
        return []
    cfg = _text_fields(hf_config)
    problems = []
    heads = _positive_int(cfg.get("num_attention_heads"))
    if heads is None:
        problems.append("config.json gives no num_attention_heads, so the attention cannot be split")
    else:
        if heads % n:
            problems.append(f"{heads} attention heads do not divide by {n}")
        kv = _positive_int(cfg.get("num_key_value_heads")) or heads
        if kv != heads and kv % n and n % kv:  # kv == heads: the line above says it
            problems.append(
                f"{kv} KV heads do not divide by {n}, and {n} is not a multiple of {kv} (to replicate them)"
            )
    size, phrase = family_of(hf_config).mlp_split(cfg)  # the MLP dimension the ranks split
    size = _positive_int(size)
    if size is not None and size % n:
        problems.append(f"{phrase.format(size)} does not divide by {n}")
    vocab = _positive_int(cfg.get("vocab_size"))
    if vocab is not None and vocab % n:
        problems.append(f"vocab size {vocab} does not divide by {n}")
    return problems


def valid_tensor_parallel_sizes(hf_config: dict[str, Any]) -> list[int]:
    """Every size from 1 up to the attention head count that fits (no size above it can split the heads)."""
    heads = _positive_int(_text_fields(hf_config).get("num_attention_heads")) or 1
    return [n for n in range(1, heads + 1) if not tensor_parallel_problems(hf_config, n)]


def tensor_parallel_error(hf_config: dict[str, Any], n: int) -> str | None:
    """The one-line startup refusal of `--tensor-parallel-size n` (None when it fits): every reason, then the
    sizes that do fit."""
    problems = tensor_parallel_problems(hf_config, n)
    if not problems:
        return None
    valid = ", ".join(str(v) for v in valid_tensor_parallel_sizes(hf_config))
    return f"--tensor-parallel-size {n} does not fit this model: {'; '.join(problems)}; valid sizes: {valid}."


def pipeline_parallel_error(hf_config: dict[str, Any], n: int) -> str | None:
    """The one-line startup refusal of `--pipeline-parallel-size n` (None when it fits): the decoder layers
    are split into n stages of consecutive layers (the earlier stages one more when they do not divide),
    so each stage needs a layer."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        return f"--pipeline-parallel-size must be at least 1 (got {n!r})."
    layers = _positive_int(_text_fields(hf_config).get("num_hidden_layers"))
    if n > 1 and layers is not None and layers < n:
        return f"--pipeline-parallel-size {n} does not fit this model: {layers} decoder layers cannot fill {n} stages."
    return None
