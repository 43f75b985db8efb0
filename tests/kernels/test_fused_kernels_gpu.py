"""The fused Triton kernels (pagoda/kernels/rms_norm.py, rotary.py, activation.py) against the layers'
PyTorch references on a CUDA GPU, at real decoder shapes (Yuan2-2B, Qwen2-VL-2B, Llama-3-8B) and T in
{1, 256, 4096} tokens.

GPU-only: skipped without CUDA (`test_rms_norm.py`, `test_rotary.py`, `test_activation.py` cover the
same kernels at tiny shapes under the Triton interpreter on the CPU). Expected, and asserted: the
residual sum of add+norm and RoPE bit-exact (0 ulps); SiLU-and-mul within 1 ulp (libdevice expf vs
CUDA's expf); RMSNorm and add + RMSNorm within 2 bf16/fp16 ulps: the fp32 mean of squares over 1.5k-4k
elements is summed in another order than PyTorch's, which at these widths moves a rounded output by up
to 2 ulps (1 at the interpreter tests' tiny widths); fp32 within a few fp32 ulps. Was
`benchmarks/fused_ops_check.py`; the kernels' speed is measured by `benchmarks/h200.py`.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="GPU correctness check: needs CUDA")


@dataclass(frozen=True)
class Shape:
    hidden: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rotary_dim: int
    intermediate: int
    theta: float
    mrope_sections: tuple[int, ...] | None = None
    qkv_has_v: bool = True  # Yuan's fused projection is [q | k] only (v comes from another GEMM)


SHAPES = {
    "yuan2-2b": Shape(2048, 32, 32, 64, 64, 8192, 10000.0, qkv_has_v=False),
    "qwen2-vl-2b": Shape(1536, 12, 2, 128, 128, 8960, 1e6, mrope_sections=(16, 24, 24)),
    "llama-3-8b": Shape(4096, 32, 8, 128, 128, 14336, 500000.0),
}
INT_VIEW = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}
# Allowed max ulps per check (the docstring says why); fp32 norms and silu: a few fp32 ulps.
LIMITS = {"rms_norm": 2, "add_rms_norm": 2, "add_rms_norm.sum": 0, "rotary": 0, "silu_and_mul": 1}
FP32_LIMITS = {**LIMITS, "rms_norm": 4, "add_rms_norm": 4, "silu_and_mul": 4}


def ulps(a: torch.Tensor, b: torch.Tensor) -> int:
    def ordered(t: torch.Tensor) -> torch.Tensor:
        bits = t.contiguous().view(INT_VIEW[t.dtype]).long()
        return torch.where(bits < 0, torch.iinfo(INT_VIEW[t.dtype]).min - bits, bits)

    return int((ordered(a) - ordered(b)).abs().max()) if a.numel() else 0


def max_ulps(outs, refs) -> int:
    outs = outs if isinstance(outs, tuple) else (outs,)
    refs = refs if isinstance(refs, tuple) else (refs,)
    return max(ulps(o, r) for o, r in zip(outs, refs))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("tokens", [1, 256, 4096])
@pytest.mark.parametrize("model", list(SHAPES))
def test_fused_ops_match_the_references_at_model_shapes(model: str, tokens: int, dtype: torch.dtype) -> None:
    from pagoda.kernels import activation as activation_kernels
    from pagoda.kernels import dispatch
    from pagoda.kernels import rms_norm as norm_kernels
    from pagoda.kernels import rotary as rotary_kernels
    from pagoda.layers.activation import silu_and_mul_reference
    from pagoda.layers.norm import rms_norm_reference
    from pagoda.layers.rotary import RotaryEmbedding, apply_rotary_reference, multimodal_cos_sin

    dev = torch.device("cuda")
    on_gpu = torch.zeros(1, device=dev)
    assert all(dispatch.fused_for(f, on_gpu) for f in dispatch.FUSED_FAMILIES), "layers do not dispatch to the kernels"
    limits = FP32_LIMITS if dtype == torch.float32 else LIMITS
    gen = torch.Generator(device=dev).manual_seed(0)

    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen, device=dev) * scale).to(dtype)

    s, t = SHAPES[model], tokens
    rope = RotaryEmbedding(s.rotary_dim, 32768, s.theta, None)
    weight = randn(s.hidden) * 0.1 + 1
    x, residual = randn(t, s.hidden), randn(t, s.hidden, scale=4.0)
    widths = [s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim]
    widths += [s.num_kv_heads * s.head_dim] if s.qkv_has_v else []
    qkv = randn(t, sum(widths), scale=2.0)
    q, k = (p.view(t, -1, s.head_dim) for p in qkv.split(widths, dim=-1)[:2])
    positions = torch.randint(0, 32768, (t,), generator=gen, device=dev)
    if s.mrope_sections:
        cos_sin = multimodal_cos_sin(
            rope, torch.stack([positions, positions // 7, positions // 13]), list(s.mrope_sections)
        )
    else:
        cos_sin = rope.cos_sin(positions)
    gate_up = randn(t, 2 * s.intermediate, scale=3.0)

    normed, summed = norm_kernels.fused_add_rms_norm(x, residual, weight, 1e-6)
    ref_normed, ref_summed = rms_norm_reference(x, weight, 1e-6, residual)
    found = {
        "rms_norm": max_ulps(norm_kernels.rms_norm(x, weight, 1e-6), rms_norm_reference(x, weight, 1e-6)),
        "add_rms_norm": max_ulps(normed, ref_normed),
        "add_rms_norm.sum": max_ulps(summed, ref_summed),
        "rotary": max_ulps(rotary_kernels.rotary(q, k, *cos_sin), apply_rotary_reference(q, k, cos_sin)),
        "silu_and_mul": max_ulps(activation_kernels.silu_and_mul(gate_up), silu_and_mul_reference(gate_up)),
    }
    off = {op: n for op, n in found.items() if n > limits[op]}
    assert not off, f"{model} T={t} {dtype}: ulps over the limit {off} (limits {limits})"
