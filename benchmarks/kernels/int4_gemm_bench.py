"""AWQ/GPTQ 4-bit matmuls on the GPU: bf16 `F.linear` vs `pagoda.kernels.int4_gemm`, per model matmul.

    python benchmarks/kernels/int4_gemm_bench.py [--shapes qwen2-vl-7b,yuan2-2b] [--rows 1,2,4,8,16,64,256]
                                    [--group-size 128] [--act-order] [--grid-rows 1,16] [--out int4.json]

Each matmul is timed the way a decode step runs it (`gemv_sweep.graph_us`): captured in a CUDA graph,
cycling through enough copies of the weight that none is still in L2. Prints µs for bf16 cuBLAS and
for the int4 kernel at its rule config (`int4_config`), their ratio, and the int4 weight stream's
GB/s (packed words, scales and zero points). Both int4 kernels are also timed at every row count where
both apply (the GEMV up to `GEMV_ROWS` rows), which is what places `policy.INT4_GEMV_MAX_ROWS`; --grid-rows sweeps a
small config grid at those row counts too. --act-order reads the groups through a permuted g_idx (an
act-order GPTQ checkpoint) instead of computing them from the group size.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # benchmarks/kernels: gemv_sweep
from gemv_sweep import L2_DEFEAT_BYTES, graph_us  # noqa: E402  (it puts the repository on sys.path)

# name → [(matmul, N, K, bias)] per decoder layer.
MATMULS = {
    "qwen2-vl-7b": [  # hidden 3584, intermediate 18944, 28 query / 4 KV heads of 128
        ("qkv", 4608, 3584, True),
        ("o", 3584, 3584, False),
        ("gate_up", 37888, 3584, False),
        ("down", 3584, 18944, False),
    ],
    "yuan2-2b": [  # hidden 2048, intermediate 8192
        ("qk_v", 6144, 2048, False),
        ("o", 2048, 2048, False),
        ("up_gate", 16384, 2048, False),
        ("down", 2048, 8192, False),
    ],
}


def int4_weights(n: int, k: int, group: int, act_order: bool, dtype, seed: int):
    """Random packed words (every nibble value), scales and zero points in Pagoda's layout, on the GPU."""
    import torch

    g = torch.Generator(device="cuda").manual_seed(seed)
    groups = k // group
    qweight = torch.randint(-(2**31), 2**31 - 1, (k // 8, n), dtype=torch.int32, device="cuda", generator=g)
    scales = (torch.rand(groups, n, device="cuda", generator=g) * 0.02 + 0.001).to(dtype)
    zeros = torch.randint(0, 16, (groups, n), device="cuda", generator=g).to(dtype)
    rows = torch.randperm(k, device="cuda", generator=g) if act_order else torch.arange(k, device="cuda")
    return qweight, scales, zeros, (rows // group).to(torch.int32)


def config_grid(m: int, gemv_rows: int):
    import triton

    from pagoda.kernels.int4_gemm import Int4Config

    if m <= gemv_rows:
        for bn, bk, split, warps in itertools.product([16, 32, 64], [128, 256], [1, 2, 4, 8], [2, 4]):
            yield Int4Config(True, 1, bn, bk, split, warps, 3)
    for bm in sorted({16, min(triton.next_power_of_2(max(16, m)), 128)}):
        for bn, bk, split, stages in itertools.product([32, 64, 128], [64, 128], [1, 2, 4, 8], [3, 4]):
            yield Int4Config(False, bm, bn, bk, split, 4 if bm * bn <= 64 * 64 else 8, stages)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="qwen2-vl-7b,yuan2-2b")
    ap.add_argument("--rows", default="1,2,4,8,16,64,256")
    ap.add_argument("--group-size", type=int, default=128)
    ap.add_argument("--act-order", action="store_true", help="groups read through a permuted g_idx")
    ap.add_argument("--grid-rows", default="", help="row counts for which a config grid is also swept")
    ap.add_argument("--out", help="write every row as JSON here")
    args = ap.parse_args()

    import torch
    import torch.nn.functional as F

    from pagoda.kernels.int4_gemm import GEMV_ROWS, int4_config, int4_matmul
    from pagoda.layers.quantization.int4_formats import int4_matmul_reference

    rows_list = [int(r) for r in args.rows.split(",")]
    grid_rows = {int(r) for r in args.grid_rows.split(",") if r}
    dtype = torch.bfloat16
    group = args.group_size
    group_size = None if args.act_order else group
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    results = []
    print(
        f"{'shape':12s} {'matmul':8s} {'N':>6s} {'K':>6s} {'M':>4s} {'bf16 us':>8s} {'int4 us':>8s} {'x':>5s} "
        f"{'int4 GB/s':>9s}  kernel"
    )
    for shape in args.shapes.split(","):
        for name, n, k, has_bias in MATMULS[shape]:
            int4_bytes = n * k // 2 + 2 * (k // group) * n * 2  # words, scales and zero points
            bf16_copies = max(2, -(-L2_DEFEAT_BYTES // (n * k * 2)))
            int4_copies = max(2, -(-L2_DEFEAT_BYTES // int4_bytes))
            dense = [torch.randn(n, k, device="cuda", dtype=dtype) / k**0.5 for _ in range(bf16_copies)]
            packed = [int4_weights(n, k, group, args.act_order, dtype, seed=i) for i in range(int4_copies)]
            bias = torch.randn(n, device="cuda", dtype=dtype) if has_bias else None
            for m in rows_list:
                x = torch.randn(m, k, device="cuda", dtype=dtype)

                def cublas(x=x, dense=dense, bias=bias):
                    for w in dense:
                        F.linear(x, w, bias)

                def int4(config=None, x=x, packed=packed, bias=bias):
                    for weights in packed:
                        int4_matmul(x, *weights, bias, group_size=group_size, config=config)

                reference = int4_matmul_reference(x.float(), *packed[0], None if bias is None else bias.float())
                got = int4_matmul(x, *packed[0], bias, group_size=group_size).float()
                rule = int4_config(m, n, k, group_size=group_size, dtype=dtype, sms=sms)
                row = {
                    "shape": shape,
                    "matmul": name,
                    "n": n,
                    "k": k,
                    "rows": m,
                    "group_size": group,
                    "act_order": args.act_order,
                    "int4_mbytes": int4_bytes / 1e6,
                    "bf16_us": graph_us(cublas, bf16_copies),
                    "int4_us": graph_us(int4, int4_copies),
                    "rule": vars(rule),
                    "max_abs_err": (got - reference).abs().max().item(),
                    "max_abs_ref": reference.abs().max().item(),
                }
                if m <= GEMV_ROWS:  # both kernels apply: time the one the rule did not pick too
                    other = int4_config(GEMV_ROWS + 1 if rule.gemv else 1, n, k, group_size=group_size, sms=sms)
                    row["other_kernel"] = vars(other)
                    row["other_kernel_us"] = graph_us(lambda c=other: int4(c), int4_copies)
                if m in grid_rows:
                    timed = [(graph_us(lambda c=c: int4(c), int4_copies), c) for c in config_grid(m, GEMV_ROWS)]
                    best_us, best = min(timed, key=lambda t: t[0])
                    row["grid_best_us"], row["grid_best"] = best_us, vars(best)
                results.append(row)
                extra = ""
                if "other_kernel_us" in row:
                    extra += f"  {'gemm' if rule.gemv else 'gemv'} {row['other_kernel_us']:7.2f}"
                if "grid_best_us" in row:
                    extra += f"  grid best {row['grid_best_us']:7.2f} {tuple(row['grid_best'].values())}"
                print(
                    f"{shape:12s} {name:8s} {n:6d} {k:6d} {m:4d} {row['bf16_us']:8.2f} {row['int4_us']:8.2f} "
                    f"{row['bf16_us'] / row['int4_us']:5.2f} {int4_bytes / row['int4_us'] / 1e3:9.0f}  "
                    f"{'gemv' if rule.gemv else 'gemm'} split {rule.split_k}{extra}",
                    flush=True,
                )
            dense = packed = None  # free this matmul's copies before the next one's
            torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
