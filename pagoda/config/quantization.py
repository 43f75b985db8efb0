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

GGUF files are not covered here: their quantized tensors are dequantized on load and run unquantized.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from pagoda.errors import ModelLoadError

SUPPORTED = (
    "fp8 (online from a bf16/fp16 checkpoint, or an FP8 checkpoint: quant_method fp8, compressed-tensors "
    "float-quantized), awq (GEMM, 4-bit), gptq (4-bit)"
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
QUANTIZATION_CHOICES = ("none", *METHOD_ALIASES)

# The last component of a tensor name → the quantization scheme that writes it.
_TENSOR_LEAVES = {
    "qweight": "awq/gptq",
    "qzeros": "awq/gptq",
    "scales": "awq/gptq",
    "g_idx": "gptq",
    "weight_scale": "fp8",
    "weight_scale_inv": "fp8",
    "input_scale": "fp8",
    "weight_packed": "compressed-tensors",
    "weight_zero_point": "compressed-tensors",
    "SCB": "bitsandbytes",
    "weight_format": "bitsandbytes",
    "absmax": "bitsandbytes",
    "quant_map": "bitsandbytes",
}
# The most specific name wins when a checkpoint has tensors of several kinds (GPTQ also has qweight).
_PRECEDENCE = ("gptq", "compressed-tensors", "bitsandbytes", "fp8", "awq/gptq")
_SIDE_FILES = (("quantize_config.json", "gptq"), ("quant_config.json", "awq"))
_MAX_HEADER_BYTES = 100 * 1024 * 1024


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


@dataclass(frozen=True)
class Quantization:
    """What was seen in a checkpoint: the method's name and where it was seen (for messages)."""

    method: str  # "awq", "gptq", "fp8", "bitsandbytes", "compressed-tensors", ...
    evidence: str  # where it was seen, for the message
    config: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def problem(self, where: str) -> str:
        return f"{where}: this quantized checkpoint ({self.method}) is not supported ({self.evidence})"

    def message(self, where: str, detail: str = "") -> str:
        return f"{self.problem(where)}{detail}; Pagoda runs {SUPPORTED}, and unquantized weights."


def config_quantization(hf_config: dict[str, Any], folder: str | None = None) -> Quantization | None:
    """From config.json (top level or `text_config`) or a quantizer's side file in `folder`."""
    for cfg, where in ((hf_config, "config.json"), (hf_config.get("text_config"), "config.json's text_config")):
        if not isinstance(cfg, dict):
            continue
        for key in ("quantization_config", "compression_config"):
            value = cfg.get(key)
            if value:
                method = (value.get("quant_method") or value.get("format")) if isinstance(value, dict) else None
                return Quantization(
                    str(method or "unknown method").lower(),
                    f"{key} in {where}",
                    value if isinstance(value, dict) else {},
                )
    if folder is not None:
        for name, default in _SIDE_FILES:
            path = os.path.join(folder, name)
            if os.path.isfile(path):
                value = _side_file(path)
                method = str(value.get("quant_method") or default).lower()
                return Quantization(method, f"{name} in the model folder", value)
    return None


def _side_file(path: str) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def tensor_quantization(names: Iterable[str]) -> Quantization | None:
    """From the tensor names alone: packed-integer weights and their scales have names of their own."""
    found: dict[str, str] = {}
    for name in names:
        leaf = name.rsplit(".", 1)[-1]
        method = _TENSOR_LEAVES.get(leaf) or ("bitsandbytes" if ".quant_state." in name else None)
        if method is not None:
            found.setdefault(method, name)
    for method in _PRECEDENCE:
        if method in found:
            return Quantization(method, f"tensor {found[method]!r}")
    return None


def checkpoint_quantization(
    location: str, kind: str, hf_config: dict[str, Any], read_tensor_names: bool = True
) -> Quantization | None:
    """Config first, then (for HF folders) the tensor names of the index or the safetensors headers.

    Reads metadata only: an index file, or the JSON header of each safetensors file. A file that cannot
    be read is passed over here; loading and `pagoda doctor` report it with their own messages."""
    if kind != "hf":
        return None
    found = config_quantization(hf_config, location)
    if found is not None or not read_tensor_names:
        return found
    return tensor_quantization(_tensor_names(location))


def resolve_quantization(
    requested: str | None, location: str, kind: str, hf_config: dict[str, Any], read_tensor_names: bool = True
) -> QuantConfig | None:
    """The QuantConfig for this checkpoint and `--quantization` (None/"none": whatever the checkpoint is).

    Raises ModelLoadError (param "model") for a checkpoint layout Pagoda does not run, and for a
    `--quantization` that contradicts the checkpoint; both in one line naming what is supported."""
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
                f"--quantization {requested} needs a {method.upper()} checkpoint (config.json with a "
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


def _tensor_names(folder: str) -> Iterable[str]:
    try:
        names = os.listdir(folder)
    except OSError:
        return
    for index in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        if index in names:
            try:
                with open(os.path.join(folder, index), encoding="utf-8") as f:
                    yield from json.load(f).get("weight_map", {})
            except (OSError, ValueError, AttributeError):
                pass
            return
    for name in sorted(names):
        if name.endswith(".safetensors"):
            yield from _safetensors_names(os.path.join(folder, name))


def _safetensors_names(path: str) -> list[str]:
    """The tensor names in a safetensors header: 8 bytes of little-endian length, then JSON."""
    try:
        with open(path, "rb") as f:
            size_bytes = f.read(8)
            if len(size_bytes) < 8:
                return []
            (size,) = struct.unpack("<Q", size_bytes)
            if size > _MAX_HEADER_BYTES:
                return []
            header = json.loads(f.read(size))
    except (OSError, ValueError):
        return []
    return [k for k in header if k != "__metadata__"] if isinstance(header, dict) else []
