"""Which quantization a model runs with: read from the checkpoint and `--quantization`, before any weight is read.

A quantized checkpoint announces itself in config.json (`quantization_config`, or `compression_config` in
older compressed-tensors exports), in a side file older AutoGPTQ/AutoAWQ exports write (`quantize_config.json`,
`quant_config.json`), or by the names of its tensors (`*.qweight`, `*.weight_scale`...). `resolve_quantization`
turns that, and the user's `--quantization`, into one frozen `QuantConfig` (or None: unquantized), or refuses in
one line that names the layout found and the layouts Pagoda runs. Without the early check an unsupported folder
would fail half-way through loading with "no matching parameter", which sends the user after the wrong problem.

Supported (what the layers in `pagoda/layers/quantization/` implement):
- fp8: FP8 e4m3 weights with per-output-channel scales, from a bf16/fp16 checkpoint quantized at load
  (`--quantization fp8`), or an FP8 checkpoint as it is: vLLM/llm-compressor's `quant_method: fp8` (per-tensor
  scales) and compressed-tensors' `float-quantized` with 8-bit float weights, tensor or channel strategy.
- awq: AutoAWQ's GEMM layout, 4 bits, any group size.
- gptq: AutoGPTQ's layout (v1 and v2 zero points), 4 bits, any group size, act-order (`desc_act`) included.

GGUF files are not covered here: their quantized tensors are dequantized on load and run unquantized
(`--quantization gguf`, vLLM's spelling, is accepted for them and changes nothing).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pagoda.errors import ModelLoadError
from pagoda.models.quantized_checkpoint import (  # noqa: F401  (re-exported: what the checks name)
    SUPPORTED,
    Quantization,
    checkpoint_quantization,
    config_quantization,
    tensor_quantization,
)

# What `--quantization` accepts: vLLM's names, its kernel-specific aliases mapped onto the method.
METHOD_ALIASES = {
    "fp8": "fp8",
    "awq": "awq",
    "awq_marlin": "awq",
    "gptq": "gptq",
    "gptq_marlin": "gptq",
    "compressed-tensors": "compressed-tensors",
}
# `--quantization gguf` (vLLM's spelling for a GGUF file): a .gguf model loads as it always does, dequantized.
GGUF = "gguf"
QUANTIZATION_CHOICES = ("none", *METHOD_ALIASES, GGUF)
# How the refusals name a checkpoint of each method (with its article).
_A_CHECKPOINT = {
    "awq": "an AWQ checkpoint",
    "gptq": "a GPTQ checkpoint",
    "compressed-tensors": "a compressed-tensors checkpoint",
}


@dataclass(frozen=True)
class QuantConfig:
    """How the decoder's linear layers are quantized; built once, handed to every process.

    method: "fp8" | "awq" | "gptq". serialized: the checkpoint holds quantized tensors (False: fp8
    computed from a bf16/fp16 checkpoint at load). ignored: module-name fragments left unquantized
    (the checkpoint's `modules_to_not_convert` / `ignore` / `ignored_layers`)."""

    method: str
    serialized: bool
    bits: int = 8
    group_size: int = -1  # awq/gptq: input rows per scale group; -1: one group over the whole input
    desc_act: bool = False  # gptq: act-order (g_idx permutes the groups)
    sym: bool = True  # gptq: symmetric (the zero point is fixed)
    checkpoint_format: str = "gptq"  # gptq: "gptq" stores zero points minus one, "gptq_v2" as they are
    fp8_weight_strategy: str = "channel"  # fp8 checkpoints: "tensor" (a scale per weight) or "channel"
    ignored: tuple[str, ...] = field(default=())

    def describe(self) -> str:
        if self.method == "fp8":
            source = f"checkpoint, {self.fp8_weight_strategy} scales" if self.serialized else "quantized at load"
            return f"fp8 e4m3 weights ({source}), activations per token"
        group = "per channel" if self.group_size == -1 else f"group size {self.group_size}"
        extra = ", act-order" if self.desc_act else ""
        return f"{self.method} int{self.bits} weights ({group}{extra})"

    def is_ignored(self, module_name: str) -> bool:
        return any(_matches(module_name, pattern) for pattern in self.ignored)


def _matches(module_name: str, pattern: str) -> bool:
    """An ignore entry: a name fragment (`lm_head`, `visual`), or compressed-tensors' `re:` regex."""
    if pattern.startswith("re:"):
        import re

        return re.match(pattern[3:], module_name) is not None
    return pattern in module_name


def resolve_quantization(
    requested: str | None, location: str, kind: str, hf_config: dict[str, Any], read_tensor_names: bool = True
) -> QuantConfig | None:
    """The QuantConfig for this checkpoint and `--quantization` (None/"none": whatever the checkpoint is).

    Raises ModelLoadError (param "model") for a checkpoint layout Pagoda does not run, and for a
    `--quantization` that contradicts the checkpoint; both in one line naming what is supported."""
    if requested == GGUF:
        if kind != "gguf":
            raise ModelLoadError(
                f"--quantization gguf needs a .gguf file, but {location} is an HF folder; omit --quantization "
                "(a folder's quantization is read from its config.json).",
                "quantization",
            )
        return None  # GGUF tensors are dequantized on load (models/gguf_checkpoint.py)
    method = None if requested in (None, "none") else METHOD_ALIASES.get(str(requested))
    if requested not in (None, "none") and method is None:
        raise ModelLoadError(
            f"--quantization {requested} is not supported; choose one of {', '.join(QUANTIZATION_CHOICES)}.",
            "quantization",
        )
    found = checkpoint_quantization(location, kind, hf_config, read_tensor_names)
    if found is None:
        if method is None:
            return None
        if method != "fp8":
            raise ModelLoadError(
                f"--quantization {requested} needs {_A_CHECKPOINT[method]} (config.json with a "
                f"quantization_config), but {location} is unquantized; only fp8 quantizes at load.",
                "quantization",
            )
        return QuantConfig(method="fp8", serialized=False, ignored=("lm_head",))
    cfg = _checkpoint_config(found, location)
    if method is not None and method != cfg.method and not (method == "compressed-tensors" and cfg.method == "fp8"):
        raise ModelLoadError(
            f"--quantization {requested} does not match the checkpoint, which is {found.method} "
            f"({found.evidence}); omit --quantization or pass {found.method}.",
            "quantization",
        )
    return cfg


def _checkpoint_config(found: Quantization, location: str) -> QuantConfig:
    """A supported checkpoint's QuantConfig; ModelLoadError naming the unsupported detail otherwise."""
    q = found.config
    if not q:  # tensor names without a config: the parameters (group size, bits...) are unknown
        raise ModelLoadError(found.message(location, ": config.json has no quantization_config describing it"), "model")

    def refuse(detail: str) -> ModelLoadError:
        return ModelLoadError(found.message(location, f": {detail}"), "model")

    method = found.method
    if method in ("awq", "gptq"):
        bits = int(q.get("bits", q.get("w_bit", 4)))
        if bits != 4:
            raise refuse(f"{bits}-bit weights (4-bit only)")
        group = int(q.get("group_size", q.get("q_group_size", -1)))
        ignored = tuple(q.get("modules_to_not_convert") or ())
        if method == "awq":
            version = str(q.get("version", "gemm")).lower()
            if version != "gemm":
                raise refuse(f"AWQ version {version!r} (the GEMM layout only)")
            if not q.get("zero_point", True):
                raise refuse("AWQ without zero points")
            return QuantConfig(method="awq", serialized=True, bits=4, group_size=group, ignored=ignored)
        fmt = str(q.get("checkpoint_format", "gptq")).lower()
        if fmt not in ("gptq", "gptq_v2"):
            raise refuse(f"GPTQ checkpoint_format {fmt!r} (gptq or gptq_v2)")
        return QuantConfig(
            method="gptq",
            serialized=True,
            bits=4,
            group_size=group,
            desc_act=bool(q.get("desc_act", False)),
            sym=bool(q.get("sym", True)),
            checkpoint_format=fmt,
            ignored=ignored,
        )
    if method == "fp8":
        if q.get("weight_block_size"):
            raise refuse(f"block-wise FP8 scales (weight_block_size {q['weight_block_size']})")
        ignored = tuple(q.get("ignored_layers") or q.get("modules_to_not_convert") or ())
        return QuantConfig(method="fp8", serialized=True, fp8_weight_strategy="tensor", ignored=ignored)
    if method == "compressed-tensors":
        return _compressed_tensors(q, refuse)
    raise refuse("this method is not implemented")


def _compressed_tensors(q: dict[str, Any], refuse: Any) -> QuantConfig:
    """compressed-tensors: FP8 weights (float-quantized, 8 bits, tensor or channel strategy) only."""
    fmt = str(q.get("format", "")).lower()
    groups = q.get("config_groups") or {}
    if fmt not in ("float-quantized", "naive-quantized") or not groups:
        raise refuse(f"compressed-tensors format {fmt or 'unknown'!r} (float-quantized FP8 only)")
    strategies = set()
    for group in groups.values():
        weights = (group or {}).get("weights") or {}
        if weights.get("type") != "float" or int(weights.get("num_bits", 0)) != 8:
            raise refuse(
                f"compressed-tensors weights {weights.get('num_bits')}-bit {weights.get('type')} (8-bit float only)"
            )
        strategy = str(weights.get("strategy", "tensor"))
        if strategy not in ("tensor", "channel"):
            raise refuse(f"compressed-tensors weight strategy {strategy!r} (tensor or channel)")
        strategies.add(strategy)
    if len(strategies) != 1:
        raise refuse("several weight strategies in one checkpoint")
    return QuantConfig(
        method="fp8", serialized=True, fp8_weight_strategy=strategies.pop(), ignored=tuple(q.get("ignore") or ())
    )
