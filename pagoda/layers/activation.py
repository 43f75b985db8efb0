"""SiLU-and-mul for gated MLPs whose gate and up projections are fused into one matmul; QuickGELU.

On CUDA tensors one Triton launch (`pagoda/kernels/activation.py`, via `pagoda/kernels/dispatch.py`);
everywhere else `silu_and_mul_reference`, which is also the kernel's reference. `of_projection`
also takes the gate/up matmul: at one row on CUDA both run as one GEMV launch
(`pagoda/kernels/gemv.py`), rounded exactly as the two launches would be.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagoda.kernels import dispatch
from pagoda.layers.linear import Linear


def quick_gelu_reference(x: torch.Tensor) -> torch.Tensor:
    """QuickGELU, x * sigmoid(1.702 x), as three PyTorch ops (each rounded to x's dtype)."""
    return x * torch.sigmoid(1.702 * x)


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    """QuickGELU (the activation the Qwen2-VL vision tower was trained with, not the erf GELU): one Triton
    pass on CUDA, rounded where the reference rounds; `quick_gelu_reference` elsewhere."""
    ops = dispatch.fused_for("activation", x)
    if ops is not None and ops.supports_quick_gelu(x):
        return ops.quick_gelu(x)
    return quick_gelu_reference(x)


def silu_and_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    """[..., 2I] laid out [gate | up] → F.silu(gate) * up: silu computed in fp32 and rounded to the
    input dtype, then the product rounded again."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


class SiluAndMul(nn.Module):
    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        # gate_up: [T, 2 * I] laid out as [gate | up]
        ops = dispatch.fused_for("activation", gate_up)
        if ops is not None and ops.supports_silu_and_mul(gate_up):
            return ops.silu_and_mul(gate_up)
        return silu_and_mul_reference(gate_up)

    def of_projection(self, proj: Linear, x: torch.Tensor) -> torch.Tensor:
        """self(proj(x)) for a fused [gate | up] projection without bias (one GEMV when the projection
        has operands for it: `Linear.gemv_operands`)."""
        kernels = dispatch.gemv_for(x)
        operands = proj.gemv_operands() if kernels is not None and proj.bias is None else None
        if operands is not None:
            weight, scale = operands
            if kernels.supports(x, weight, max_rows=1, weight_scale=scale):
                return kernels.gemv_silu_and_mul(x, weight, weight_scale=scale)
        return self(proj(x))
