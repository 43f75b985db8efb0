"""Recognizing a quantized checkpoint from its metadata: config.json's `quantization_config` (or
`compression_config`), a quantizer's side file, or the names of its tensors — without reading a weight.

What is recognized here is judged in `pagoda/config/quantization.py` (`resolve_quantization`): run as a
`QuantConfig`, or refused in one line. The loader uses `tensor_quantization` on the names a pickled
checkpoint reveals only when read.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

SUPPORTED = (
    "fp8 (online from a bf16/fp16 checkpoint, or an FP8 checkpoint: quant_method fp8, compressed-tensors "
    "float-quantized), awq (GEMM, 4-bit), gptq (4-bit)"
)

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
