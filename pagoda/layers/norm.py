"""RMSNorm (decoder layers) and LayerNorm (the Qwen2-VL vision tower), computed in float32 like the HF
reference and cast back; each optionally fused with the residual add that precedes it.

On CUDA tensors the Triton kernels in `pagoda/kernels/rms_norm.py` and `pagoda/kernels/layer_norm.py` do it in
one launch (see `pagoda/kernels/dispatch.py`); everywhere else `rms_norm_reference` / `layer_norm_reference`
run, which are also the kernels' references.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagoda.kernels import dispatch


def rms_norm_reference(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """weight * rms_norm(x); with a residual, (weight * rms_norm(s), s) for s = x + residual, the
    sum rounded to the activation dtype first (it is the next residual stream)."""
    if residual is not None:
        summed = x + residual
        return rms_norm_reference(summed, weight, eps), summed
    # Fused kernel (one pass instead of five elementwise ops); statistics in float32 as in HF: the
    # normalized value is rounded to the input dtype, THEN multiplied by the weight in that dtype.
    dtype = x.dtype
    normed = F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(dtype)
    return weight * normed


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """x [..., H] → normed; with `residual`, (normed(x + residual), x + residual)."""
        ops = dispatch.fused_for("rms_norm", x)
        if ops is not None and ops.supports_rms_norm(x, self.weight, residual):
            if residual is None:
                return ops.rms_norm(x, self.weight, self.eps)
            return ops.fused_add_rms_norm(x, residual, self.weight, self.eps)
        return rms_norm_reference(x, self.weight, self.eps, residual)


def layer_norm_reference(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """F.layer_norm over the last dim (nn.LayerNorm's numerics); with a residual, (layer_norm(s), s) for
    s = x + residual, the sum rounded to the activation dtype first (it is the next residual stream)."""
    if residual is not None:
        summed = x + residual
        return F.layer_norm(summed, (x.shape[-1],), weight, bias, eps), summed
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


class LayerNorm(nn.Module):
    """nn.LayerNorm's parameters (`weight`, `bias`) and result, with the residual add before it fused."""

    def __init__(self, hidden_size: int, eps: float = 1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.bias = nn.Parameter(torch.zeros(hidden_size))
        self.eps = eps

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """x [..., H] → normed; with `residual`, (normed(x + residual), x + residual)."""
        ops = dispatch.fused_for("layer_norm", x)
        if ops is not None and ops.supports_layer_norm(x, self.weight, self.bias, residual):
            if residual is None:
                return ops.layer_norm(x, self.weight, self.bias, self.eps)
            return ops.fused_add_layer_norm(x, residual, self.weight, self.bias, self.eps)
        return layer_norm_reference(x, self.weight, self.bias, self.eps, residual)
