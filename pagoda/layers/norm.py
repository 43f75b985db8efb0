"""RMSNorm, computed in float32 like the HF reference and cast back."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Fused kernel (one pass instead of five elementwise ops); statistics in float32 as in HF.
        dtype = x.dtype
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(dtype)
        return self.weight * normed
