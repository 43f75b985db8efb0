"""Linear layers that own how checkpoint tensors land in their parameters.

`MergedLinear` fuses several projections that read the same input (q/k/v, gate/up) into one
matmul; each checkpoint tensor is copied into its slice of the fused weight by `weight_loader`.
These are single-device layers; the tensor-parallel variants will keep the same loader contract
(narrow the checkpoint tensor to the rank's shard first).

`linear` is the one matmul entry point: on CUDA, inputs of at most `gemv.MAX_ROWS` rows (decode at
batch 1) go to the Triton GEMV (`pagoda/kernels/gemv.py`: cuBLAS is latency-bound there), all
others to `F.linear`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagoda.kernels import dispatch


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias), through the few-row GEMV kernel where it applies."""
    kernels = dispatch.gemv_for(x)
    if kernels is not None and kernels.supports(x, weight) and (bias is None or bias.dtype == x.dtype):
        return kernels.gemv(x, weight, bias)
    return F.linear(x, weight, bias)


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
    if param.shape != loaded.shape:
        raise ValueError(f"shape mismatch: parameter {tuple(param.shape)} vs checkpoint {tuple(loaded.shape)}")
    param.data.copy_(loaded)


class Linear(nn.Module):
    def __init__(self, input_size: int, output_size: int, bias: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(output_size, input_size))
        self.bias = nn.Parameter(torch.empty(output_size)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


class MergedLinear(Linear):
    """Outputs of several projections concatenated: [out_0 | out_1 | ...]; shard ids index them."""

    def __init__(
        self, input_size: int, output_sizes: list[int], bias: bool = False, shard_names: tuple[str, ...] | None = None
    ):
        super().__init__(input_size, sum(output_sizes), bias)
        self.output_sizes = output_sizes
        self.shard_names = shard_names or tuple(str(i) for i in range(len(output_sizes)))

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        index = self.shard_names.index(str(shard_id))
        offset = sum(self.output_sizes[:index])
        target = param.data.narrow(0, offset, self.output_sizes[index])
        if target.shape != loaded.shape:
            raise ValueError(f"shape mismatch for shard {shard_id}: {tuple(target.shape)} vs {tuple(loaded.shape)}")
        target.copy_(loaded)
