"""Few-row matmuls on the GPU: cuBLAS (`F.linear`) vs `pagoda.kernels.gemv`, per model matmul.

    python benchmarks/kernels/gemv_sweep.py [--shapes yuan2-2b,qwen2-vl-2b,llama-3-8b,smollm2-135m] [--rows 1,2,4,8]
                                    [--grid-rows 2,4] [--grid-block-n 1,2,4] [--grid-block-k 1024,2048,4096]
                                    [--grid-warps 2,4,8] [--l2-hot] [--out sweep.json]

Each matmul is timed the way a decode step runs it: captured in a CUDA graph (no Python launch
cost), cycling through enough copies of the weight that none is still in L2 (a step reads each
layer's weights once, from HBM). Prints µs and weight-stream TB/s for cuBLAS and for the kernel at
its rule config (`gemv_config`), which of the two `layers.linear` runs (`gemv.max_rows_for`), and for
--grid-rows the best of a small config grid too: where the rule loses, or where the kernel stops beating
cuBLAS (`policy.GEMV_MAX_ROWS` and `policy.GEMV_LOOP_ROWS` come from that).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the repository

# name → [(matmul, N, K, bias)] per decoder layer, then the lm_head.
MATMULS = {
    "yuan2-2b": [
        ("lf_conv1", 1024, 4096, True),
        ("lf_conv2", 2048, 2048, True),
        ("qk", 4096, 2048, False),
        ("v", 2048, 2048, False),
        ("o", 2048, 2048, False),
        ("up_gate", 16384, 2048, False),
        ("down", 2048, 8192, False),
        ("lm_head", 135040, 2048, False),
    ],
    "qwen2-vl-2b": [
        ("qkv", 2048, 1536, True),
        ("o", 1536, 1536, False),
        ("gate_up", 17920, 1536, False),
        ("down", 1536, 8960, False),
        ("lm_head", 151936, 1536, False),
    ],
    "smollm2-135m": [  # the embedded default model: latency-bound matmuls, where speculation's rows land
        ("qkv", 960, 576, False),
        ("o", 576, 576, False),
        ("gate_up", 3072, 576, False),
        ("down", 576, 1536, False),
        ("lm_head", 49152, 576, False),
    ],
    "llama-3-8b": [
        ("qkv", 6144, 4096, False),
        ("o", 4096, 4096, False),
        ("gate_up", 28672, 4096, False),
        ("down", 4096, 14336, False),
        ("lm_head", 128256, 4096, False),
    ],
}
L2_DEFEAT_BYTES = 400 * 2**20  # the H200's L2 is 50 MB; cycle through at least this many bytes


def graph_us(fn, calls: int, repeats: int = 5, replays: int = 20) -> float:
    """Best-of-repeats µs per call of one CUDA graph holding `calls` calls of fn."""
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) * 1e3 / replays / calls)
    return best


def main() -> None:
    import torch
    import torch.nn.functional as F

    from pagoda.kernels.gemv import GemvConfig, gemv, gemv_config, supports

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="yuan2-2b,qwen2-vl-2b,llama-3-8b")
    ap.add_argument("--rows", default="1,2,4,8")
    ap.add_argument("--grid-rows", default="", help="row counts for which a config grid is also swept")
    ap.add_argument("--grid-block-n", default="1,2,4", help="the grid's output columns per program")
    ap.add_argument("--grid-block-k", default="1024,2048,4096", help="the grid's K tiles (those below 2K are swept)")
    ap.add_argument("--grid-warps", default="2,4,8", help="the grid's warp counts")
    ap.add_argument(
        "--l2-hot",
        action="store_true",
        help="also time the kernel re-reading one weight (L2-resident after the first call): what a "
        "matmul whose weight was prefetched into L2 would cost",
    )
    ap.add_argument("--out")
    args = ap.parse_args()
    rows_list = [int(r) for r in args.rows.split(",")]
    grid_rows = {int(r) for r in args.grid_rows.split(",") if r}
    axes = [[int(v) for v in a.split(",")] for a in (args.grid_block_n, args.grid_block_k, args.grid_warps)]
    grid = [GemvConfig(bn, bk, nw) for bn, bk, nw in itertools.product(*axes)]
    results = []
    dtype = torch.bfloat16
    for shape in args.shapes.split(","):
        for name, n, k, has_bias in MATMULS[shape]:
            copies = max(2, -(-L2_DEFEAT_BYTES // (n * k * 2)))
            weights = [torch.randn(n, k, device="cuda", dtype=dtype) / k**0.5 for _ in range(copies)]
            bias = torch.randn(n, device="cuda", dtype=dtype) if has_bias else None
            mbytes = n * k * 2 / 1e6
            for m in rows_list:
                x = torch.randn(m, k, device="cuda", dtype=dtype)
                out = torch.empty(m, n, device="cuda", dtype=dtype)

                def cublas(x=x, out=out, weights=weights, bias=bias):
                    for w in weights:
                        torch.addmm(bias, x, w.t(), out=out) if bias is not None else torch.mm(x, w.t(), out=out)

                def kernel(config, x=x, out=out, weights=weights, bias=bias):
                    for w in weights:
                        gemv(x, w, bias, out=out, config=config)

                ref = F.linear(x.float(), weights[0].float(), None if bias is None else bias.float())
                err = (gemv(x, weights[0], bias).float() - ref).abs().max().item()
                row = {
                    "shape": shape,
                    "matmul": name,
                    "n": n,
                    "k": k,
                    "rows": m,
                    "mbytes": mbytes,
                    "cublas_us": graph_us(cublas, copies),
                    "rule": vars(gemv_config(m, n, k)),
                    "policy": "gemv" if supports(x, weights[0]) else "cublas",  # what `layers.linear` runs
                    "max_abs_err": err,
                }
                row["gemv_us"] = graph_us(lambda: kernel(None), copies)
                if args.l2_hot:

                    def hot(x=x, out=out, w=weights[0], bias=bias, copies=copies):
                        for _ in range(copies):
                            gemv(x, w, bias, out=out)

                    row["gemv_l2_hot_us"] = graph_us(hot, copies)
                if m in grid_rows:
                    timed = [(graph_us(lambda c=c: kernel(c), copies), c) for c in grid if c.block_k < 2 * k]
                    best_us, best = min(timed, key=lambda t: t[0])
                    row["grid_best_us"], row["grid_best"] = best_us, vars(best)
                    row["grid"] = [dict(vars(c), us=us) for us, c in timed]  # every config, to pick one for all rows
                results.append(row)
                extra = (
                    f"  grid best {row['grid_best_us']:7.2f} {tuple(row['grid_best'].values())}"
                    if "grid_best_us" in row
                    else ""
                )
                extra += f"  L2-hot gemv {row['gemv_l2_hot_us']:7.2f} us" if "gemv_l2_hot_us" in row else ""
                print(
                    f"{shape:12s} {name:9s} M={m:2d}  cuBLAS {row['cublas_us']:7.2f} us "
                    f"({mbytes / row['cublas_us']:4.2f} TB/s)  gemv {row['gemv_us']:7.2f} us "
                    f"({mbytes / row['gemv_us']:4.2f} TB/s)  x{row['cublas_us'] / row['gemv_us']:.2f}"
                    f"  runs {row['policy']:6s}"
                    f"{extra}",
                    flush=True,
                )
            weights = None  # free this matmul's copies before the next one's
            torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
