"""Quantized linear layers: which layers a `QuantConfig` quantizes, and their methods.

`quantize_linear_layers` runs on a built model (parameters allocated in the model dtype, before any
weight is read): every column/row-parallel projection of the decoder (q/k/v, o, gate/up, down, and
Yuan2's v/o and experts) gets a method that replaces its `weight` with the method's parameters and
does its matmul (`Linear.quant`). Left in the model dtype: the embedding and LM head, the replicated
layers (the Qwen2-VL vision tower, Yuan2's localized-filter convolutions and router, its fused q/k
projection with its own loader), and whatever the checkpoint lists as not converted.
`process_after_loading` then turns the loaded tensors into what the kernels read.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from pagoda.layers.linear import (
    ColumnParallelLinear,
    Linear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)

if TYPE_CHECKING:  # the config is built above the models; here only its fields are read
    from pagoda.config.quantization import QuantConfig

# Exactly these classes: a subclass with a loader of its own (Yuan2's q/k projection) stays unquantized.
QUANTIZABLE = (ColumnParallelLinear, MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear)
# Checkpoint entries the methods do not use: static activation scales (activations are quantized per
# token), and the KV-cache scales when they sit on a projection (read separately by the loader).
UNUSED_LEAVES = ("input_scale",)


def _method(config: QuantConfig):  # -> Fp8LinearMethod | Int4LinearMethod
    if config.method == "fp8":
        from pagoda.layers.quantization.fp8 import Fp8LinearMethod

        return Fp8LinearMethod(config)
    from pagoda.layers.quantization.int4 import Int4LinearMethod

    return Int4LinearMethod(config)


def quantize_linear_layers(model: nn.Module, config: QuantConfig, dtype: torch.dtype, device: torch.device) -> int:
    """Give each quantizable layer its method and parameters; returns how many layers were quantized."""
    count = 0
    for name, module in model.named_modules():
        if type(module) not in QUANTIZABLE or config.is_ignored(name):
            continue
        assert isinstance(module, Linear)
        method = _method(config)
        method.create_weights(module, dtype, device)
        module.quant = method
        count += 1
    return count


@torch.no_grad()
def process_after_loading(model: nn.Module) -> None:
    for module in model.modules():
        method = getattr(module, "quant", None)
        if method is not None:
            method.process_after_loading(module)
