"""What the fused-kernel tests share: the kernel modules by family, ulp distances, seeded inputs.

Import it after the test module's Triton check (it imports the kernels)."""

from __future__ import annotations

import torch

from pagoda.kernels import activation as activation_kernels
from pagoda.kernels import layer_norm as layer_norm_kernels
from pagoda.kernels import localized_filter as lf_kernels
from pagoda.kernels import rms_norm as norm_kernels
from pagoda.kernels import rotary as rotary_kernels

# The fused kernel modules by family, as `dispatch.fused_for` names them.
FUSED = {
    "rms_norm": norm_kernels,
    "layer_norm": layer_norm_kernels,
    "rotary": rotary_kernels,
    "activation": activation_kernels,
    "localized_filter": lf_kernels,
}
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
INT_VIEW = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


def ulps(a: torch.Tensor, b: torch.Tensor) -> int:
    """Largest distance between a and b in units in the last place of their (same) dtype."""
    assert a.dtype == b.dtype and a.shape == b.shape

    def ordered(t: torch.Tensor) -> torch.Tensor:
        bits = t.contiguous().view(INT_VIEW[t.dtype]).long()
        return torch.where(bits < 0, torch.iinfo(INT_VIEW[t.dtype]).min - bits, bits)  # monotone in value

    return int((ordered(a) - ordered(b)).abs().max()) if a.numel() else 0


def randn(*shape: int, dtype: torch.dtype, scale: float = 1.0, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype).to(DEVICE)


def check_normed(out: torch.Tensor, ref: torch.Tensor) -> None:
    """Same rounding points; only the fp32 sum of squares is ordered differently, so an fp32 ulp or
    two of the normalized value, which rarely moves a bf16/fp16 result by one ulp."""
    assert ulps(out, ref) <= (4 if out.dtype == torch.float32 else 1)
    if out.dtype != torch.float32:
        assert (out != ref).float().mean() <= 0.02


def qkv_views(t: int, hq: int, hkv: int, d: int, dtype: torch.dtype, seed: int):
    """q, k as the models make them: views into one fused qkv projection output (rows strided)."""
    qkv = randn(t, (hq + 2 * hkv) * d, dtype=dtype, scale=2.0, seed=seed)
    q, k, _ = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    return q.view(t, hq, d), k.view(t, hkv, d)
