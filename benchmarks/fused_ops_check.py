"""Check the fused Triton kernels (pagoda/kernels/fused_ops.py) against their PyTorch references on a
CUDA GPU, at the decoder shapes of Yuan2-2B, Qwen2-VL-2B and Llama-3-8B, for T in {1, 256, 4096}:
errors (max |diff|, max ulps, fraction of elements that differ at all) and the time of both
(triton.testing.do_bench, median ms).

    PYTHONPATH=$PWD python benchmarks/fused_ops_check.py   # bf16 (from the repository root)
    python benchmarks/fused_ops_check.py --dtype float16 --tokens 1 4096
    python benchmarks/fused_ops_check.py --device cpu --tokens 1 --models qwen2-vl-2b   # smoke test,
                                                           # Triton interpreter, wall-clock timing

Expected: the residual sum (`sum` column of add+norm) and RoPE bit-exact (0 ulps); SiLU-and-mul
bit-exact or nearly (libdevice expf vs CUDA's expf); RMSNorm within 1 bf16 ulp on a small fraction of
elements (fp32 summation order of the mean of squares). Exit status 1 if a result is off by more.
The "layer" row adds what one decoder layer runs: 2 x add+norm, RoPE, SiLU-and-mul.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass

import torch

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
    qkv_has_v: bool = True        # Yuan's fused projection is [q | k] only (v comes from another GEMM)


SHAPES = {
    "yuan2-2b": Shape(2048, 32, 32, 64, 64, 8192, 10000.0, qkv_has_v=False),
    "qwen2-vl-2b": Shape(1536, 12, 2, 128, 128, 8960, 1e6, mrope_sections=(16, 24, 24)),
    "llama-3-8b": Shape(4096, 32, 8, 128, 128, 14336, 500000.0),
}
INT_VIEW = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}
# Allowed max ulps per check (the exit status); see the docstring. fp32 norms and silu: a few fp32 ulps.
LIMITS = {"rms_norm": 1, "add_rms_norm": 1, "add_rms_norm.sum": 0, "rotary": 0, "silu_and_mul": 1}
FP32_LIMITS = {**LIMITS, "rms_norm": 4, "add_rms_norm": 4, "silu_and_mul": 4}


def ulps(a: torch.Tensor, b: torch.Tensor) -> int:
    def ordered(t: torch.Tensor) -> torch.Tensor:
        bits = t.contiguous().view(INT_VIEW[t.dtype]).long()
        return torch.where(bits < 0, torch.iinfo(INT_VIEW[t.dtype]).min - bits, bits)

    return int((ordered(a) - ordered(b)).abs().max()) if a.numel() else 0


def compare(outs, refs) -> tuple[float, int, float]:
    outs = outs if isinstance(outs, tuple) else (outs,)
    refs = refs if isinstance(refs, tuple) else (refs,)
    err = max((o.float() - r.float()).abs().max().item() for o, r in zip(outs, refs))
    ulp = max(ulps(o, r) for o, r in zip(outs, refs))
    differ = sum((o != r).sum().item() for o, r in zip(outs, refs)) / sum(o.numel() for o in outs)
    return err, ulp, differ


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 256, 4096])
    parser.add_argument("--models", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("needs a CUDA GPU (or --device cpu for a smoke test)", file=sys.stderr)
        return 2
    if args.device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"      # before the kernels are defined

    import triton

    if args.device == "cuda":
        from triton.testing import do_bench
    else:
        def do_bench(fn, warmup: int = 0, rep: int = 0) -> float:
            fn()
            start = time.perf_counter()
            fn()
            return (time.perf_counter() - start) * 1e3

    from pagoda.kernels import dispatch, fused_ops
    from pagoda.layers.activation import silu_and_mul_reference
    from pagoda.layers.norm import rms_norm_reference
    from pagoda.layers.rotary import RotaryEmbedding, apply_rotary_reference, multimodal_cos_sin

    dtype = getattr(torch, args.dtype)
    dev = torch.device(args.device)
    probe = torch.zeros(1, device=dev)
    device_name = torch.cuda.get_device_name() if args.device == "cuda" else "CPU (Triton interpreter)"
    limits = FP32_LIMITS if dtype == torch.float32 else LIMITS
    print(f"{device_name}  torch {torch.__version__}  triton {triton.__version__}  {args.dtype}")
    print(f"layers dispatch to the kernels: {dispatch.fused_ops_for(probe) is not None}")
    header = f"{'model':<12} {'T':>5} {'op':<16} {'max|err|':>10} {'ulps':>5} {'differ':>8} {'ref ms':>9} {'fused ms':>9} {'x':>6}"
    print(header)
    print("-" * len(header))
    failures = []
    gen = torch.Generator(device=dev).manual_seed(0)

    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen, device=dev) * scale).to(dtype)

    for name in args.models:
        s = SHAPES[name]
        rope = RotaryEmbedding(s.rotary_dim, 32768, s.theta, None)
        weight = randn(s.hidden) * 0.1 + 1
        for t in args.tokens:
            x, residual = randn(t, s.hidden), randn(t, s.hidden, scale=4.0)
            widths = [s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim]
            widths += [s.num_kv_heads * s.head_dim] if s.qkv_has_v else []
            qkv = randn(t, sum(widths), scale=2.0)
            q, k = (p.view(t, -1, s.head_dim) for p in qkv.split(widths, dim=-1)[:2])
            positions = torch.randint(0, 32768, (t,), generator=gen, device=dev)
            if s.mrope_sections:
                pos3 = torch.stack([positions, positions // 7, positions // 13])
                cos_sin = multimodal_cos_sin(rope, pos3, list(s.mrope_sections))
            else:
                cos_sin = rope.cos_sin(positions)
            gate_up = randn(t, 2 * s.intermediate, scale=3.0)
            cases = {
                "rms_norm": (lambda: fused_ops.rms_norm(x, weight, 1e-6),
                             lambda: rms_norm_reference(x, weight, 1e-6)),
                "add_rms_norm": (lambda: fused_ops.fused_add_rms_norm(x, residual, weight, 1e-6),
                                 lambda: rms_norm_reference(x, weight, 1e-6, residual)),
                "rotary": (lambda: fused_ops.rotary(q, k, *cos_sin),
                           lambda: apply_rotary_reference(q, k, cos_sin)),
                "silu_and_mul": (lambda: fused_ops.silu_and_mul(gate_up),
                                 lambda: silu_and_mul_reference(gate_up)),
            }
            layer = {"ref": 0.0, "fused": 0.0}
            for op, (fused, ref) in cases.items():
                out, expected = fused(), ref()
                err, ulp, differ = compare(out, expected)
                checks = {op: ulp}
                if op == "add_rms_norm":
                    checks = {op: compare(out[0], expected[0])[1], f"{op}.sum": compare(out[1], expected[1])[1]}
                for key, value in checks.items():
                    if value > limits[key]:
                        failures.append(f"{name} T={t} {key}: {value} ulps")
                ms_ref = do_bench(ref, warmup=25, rep=100)
                ms_fused = do_bench(fused, warmup=25, rep=100)
                print(f"{name:<12} {t:>5} {op:<16} {err:>10.3g} {ulp:>5} {differ:>8.2%} "
                      f"{ms_ref:>9.4f} {ms_fused:>9.4f} {ms_ref / ms_fused:>6.2f}")
                if op != "rms_norm":
                    repeat = 2 if op == "add_rms_norm" else 1
                    layer["ref"] += repeat * ms_ref
                    layer["fused"] += repeat * ms_fused
            print(f"{name:<12} {t:>5} {'layer':<16} {'':>10} {'':>5} {'':>8} "
                  f"{layer['ref']:>9.4f} {layer['fused']:>9.4f} {layer['ref'] / layer['fused']:>6.2f}")
    print()
    if failures:
        print("OFF BY MORE THAN EXPECTED:\n  " + "\n  ".join(failures))
        return 1
    print("all within the expected ulps")
    return 0


if __name__ == "__main__":
    sys.exit(main())
