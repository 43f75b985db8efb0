"""Where a GGUF 4-bit layer's two CPU matmul paths cross: PyTorch's int4 kernel against the layer dequantized
for one dense matmul (`layers/quantization/cpu_int4.py`), summed over one decoder layer of the embedded model
(SmolLM2-135M: q/k/v 576 → 960, o 576 → 576, gate/up 576 → 3072, down 1536 → 576), per row count.

    python benchmarks/kernels/cpu_int4_rows.py [--rows 4 8 16 32 48 64 96] [--threads N]

`policy.CPU_INT4_MAX_ROWS` should sit at the last row count where the kernel is the faster. Random levels and
scales: the timings do not depend on the values.
"""

from __future__ import annotations

import argparse
import time

import torch

from pagoda.kernels import policy
from pagoda.layers.quantization.cpu_int4 import GROUP, CpuInt4Method

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}  # (N, K)


def timed_ms(fn, repeat: int) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - start) / repeat * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[4, 8, 16, 32, 48, 64, 96])
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--repeat", type=int, default=20)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    layers = {
        name: CpuInt4Method(
            torch.randint(0, 16, (n, k), dtype=torch.uint8),
            torch.rand(n, k // GROUP) * 0.01,
            -torch.rand(n, k // GROUP) * 0.05,
        )
        for name, (n, k) in SHAPES.items()
    }
    kernel = torch.ops.aten._weight_int4pack_mm_for_cpu
    print(f"threads {torch.get_num_threads()}, policy.CPU_INT4_MAX_ROWS = {policy.CPU_INT4_MAX_ROWS}")
    print(f"{'rows':>5} {'int4 kernel ms':>15} {'dequantized ms':>15} {'faster':>12}")
    for rows in args.rows:
        kernel_ms = dense_ms = 0.0
        for name, (_, k) in SHAPES.items():
            layer, x = layers[name], torch.randn(rows, k).to(torch.bfloat16)
            kernel_ms += timed_ms(lambda x=x, m=layer: kernel(x, m.packed, GROUP, m.scales_zeros), args.repeat)
            dense = x.to(layer.prefill_dtype)
            dense_ms += timed_ms(lambda x=dense, m=layer: torch.mm(x, m.dequantized_t()), args.repeat)
        faster = "int4 kernel" if kernel_ms <= dense_ms else "dequantized"
        print(f"{rows:>5} {kernel_ms:>15.3f} {dense_ms:>15.3f} {faster:>12}")


if __name__ == "__main__":
    main()
